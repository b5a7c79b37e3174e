"""Benchmarks reach flame through its public names only, and library comments state facts without
citing benchmark runs or findings. Read from the source (no import)."""
import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def private_flame_names(path: str) -> list[str]:
    """``_name`` imported from flame, or reached as an attribute of a flame module, in ``path``."""
    tree = ast.parse(open(path).read(), path)
    flame_aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or '').split('.')[0] == 'flame':
            for a in node.names:
                if a.name.startswith('_'):
                    found.append(f'{node.module}.{a.name}')
                else:
                    flame_aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split('.')[0] == 'flame':
                    flame_aliases.add((a.asname or a.name).split('.')[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith('_') and not node.attr.startswith('__'):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in flame_aliases:
                found.append(f'{base.id}...{node.attr}')
    return found


def test_private_name_detector_finds_both_forms(tmp_path):
    src = tmp_path / 'b.py'
    src.write_text('from flame.ops.attention.parallel import LOG2E, _cdiv\nimport flame.offload as off\n'
                   'off.runtime._time_cuda()\nimport torch\ntorch._dynamo.reset()\n')
    assert private_flame_names(str(src)) == ['flame.ops.attention.parallel._cdiv', 'off..._time_cuda']


def test_benchmarks_use_public_flame_names_only():
    bad = {os.path.relpath(p, ROOT): names for p in sorted(glob.glob(os.path.join(ROOT, 'benchmarks', '*.py')))
           if (names := private_flame_names(p))}
    assert bad == {}


# a finding is cited as O<n>; a compiler's -O<n> flag is not one
CITATION = re.compile(r'\brun \d+\b|\bfinding\b|(?<!-)\bO\d{1,2}\b|\bcall c?\d\b|\(run 20\d\d-|benchmarks/results')


def test_library_comments_cite_no_runs_or_findings():
    hits = []
    for path in sorted(glob.glob(os.path.join(ROOT, 'flame', '**', '*.py'), recursive=True)):
        for i, line in enumerate(open(path), 1):
            if CITATION.search(line):
                hits.append(f'{os.path.relpath(path, ROOT)}:{i}: {line.strip()}')
    assert hits == []
