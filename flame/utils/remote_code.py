"""Modeling code inside an export folder, so that ``from_pretrained(dir, trust_remote_code=True)`` works
without flame (or the user's package) installed.

The code is not a second copy kept by hand: at export time ``bundle`` walks the imports of the
config and model classes' modules and copies every module of flame, ``custom_models`` and the
model's own package that they reach into the folder as one flat file each
(``flame.models.attention.layer`` -> ``flame_models_attention_layer.py``), rewriting those imports
to relative ones (transformers' remote-code loader follows ``from .x import y``). Each imported
name is taken from the module that defines it, so package ``__init__`` files (which pull in GPU
kernels) are not copied. Imports of other packages are kept when transformers needs them anyway
(torch, transformers, the standard library...); inside functions, imports of optional packages
(FLA's fused GPU kernels) are put in ``try`` blocks that re-raise, which keeps their meaning and
keeps transformers from requiring the package at load time.

Two modules are replaced, not copied: FLA's ``TransformerConfig`` (the base of flame's; a class
with the same fields and defaults, generated from its signature) and flame's Triton attention
kernels (the pure-torch reference computes the same attention).
"""
from __future__ import annotations

import ast
import importlib
import inspect
import sys

# top-level packages transformers' remote code may import (transformers itself depends on them)
ALLOWED_TOP = {'torch', 'transformers', 'numpy', 'safetensors', 'huggingface_hub', 'tokenizers', '__future__'}
ALWAYS_BUNDLED = ('flame', 'custom_models')

PARALLEL_SUBSTITUTE = '''"""Exported stand-in for flame's Triton attention kernels: the pure-torch reference
(``flame.ops.attention.naive``) computes the same attention, with O(T^2) memory."""
from flame.ops.attention.naive import naive_attention


def parallel_attention(q, k, v, mode="softmax", *, scale=None, eps=1e-6, cu_seqlens=None, max_seqlen=None):
    o, _ = naive_attention(q, k, v, mode, scale=scale, eps=eps, cu_seqlens=cu_seqlens, return_weights=False)
    return o
'''

# FLA's config __init__ forwards these to PretrainedConfig; the rest become attributes
_SUPER_KEYS = ('pad_token_id', 'bos_token_id', 'eos_token_id', 'tie_word_embeddings')


def _fla_transformer_config_source() -> str:
    """A PretrainedConfig with the fields and defaults of FLA's TransformerConfig (read from its
    signature at export time, so the two cannot drift apart)."""
    from fla.models.transformer.configuration_transformer import TransformerConfig

    params = [p for p in inspect.signature(TransformerConfig.__init__).parameters.values()
              if p.name != 'self' and p.kind is p.POSITIONAL_OR_KEYWORD]
    args = ', '.join(f'{p.name}={p.default!r}' for p in params)
    own = [p.name for p in params if p.name not in _SUPER_KEYS]
    fwd = ', '.join(f'{k}={k}' for k in _SUPER_KEYS if k in {p.name for p in params})
    lines = [
        '"""Exported stand-in for FLA\'s TransformerConfig: the same fields and defaults."""',
        'from transformers import PretrainedConfig',
        '', '',
        'class TransformerConfig(PretrainedConfig):',
        f'    model_type = {TransformerConfig.model_type!r}',
        f'    keys_to_ignore_at_inference = {list(getattr(TransformerConfig, "keys_to_ignore_at_inference", []))!r}',
        '',
        f'    def __init__(self, {args}, **kwargs):',
        *[f'        self.{k} = {k}' for k in own],
        f'        super().__init__({fwd}, **kwargs)',
        '',
    ]
    return '\n'.join(lines)


SUBSTITUTES = {
    'flame.ops.attention.parallel': lambda: PARALLEL_SUBSTITUTE,
    'fla.models.transformer.configuration_transformer': _fla_transformer_config_source,
}


class BundleError(Exception):
    """The code cannot be made self-contained (the message says why)."""


def flat_name(module: str) -> str:
    return module.replace('.', '_')


def _stdlib(top: str) -> bool:
    return top in sys.stdlib_module_names


def _source(module: str) -> str:
    if module in SUBSTITUTES:
        return SUBSTITUTES[module]()
    mod = importlib.import_module(module)
    try:
        return inspect.getsource(mod)
    except (OSError, TypeError) as e:
        raise BundleError(f"no source for module {module!r}: {e}") from None


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ''
    parts = module.split('.')
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - (node.level - 1)]
    return '.'.join(base + ([node.module] if node.module else []))


class Bundler:
    def __init__(self, packages: tuple[str, ...]):
        self.packages = tuple(dict.fromkeys(ALWAYS_BUNDLED + packages))
        self.files: dict[str, str] = {}
        self.queue: list[str] = []

    def bundled(self, module: str) -> bool:
        return module in SUBSTITUTES or module.split('.')[0] in self.packages

    def add(self, module: str) -> str:
        name = flat_name(module)
        if name + '.py' not in self.files and module not in self.queue:
            self.queue.append(module)
        return name

    def run(self) -> dict[str, str]:
        while self.queue:
            module = self.queue.pop(0)
            self.files[flat_name(module) + '.py'] = self.rewrite(module)
        return self.files

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, str]:
        """(module that defines ``name``, its name there) for ``from module import name``."""
        if depth > 20:
            raise BundleError(f"cannot find where {module}.{name} is defined")
        if module in SUBSTITUTES:
            return module, name
        mod = importlib.import_module(module)
        obj = getattr(mod, name, None)
        if inspect.ismodule(obj):
            raise BundleError(f"'from {module} import {name}' imports a module; import names from it instead")
        home = getattr(obj, '__module__', None)
        if (home and self.bundled(home) and getattr(sys.modules.get(home), getattr(obj, '__name__', name), None) is obj):
            return home, obj.__name__
        # constants (no __module__): defined here, or re-exported through a from-import
        tree = ast.parse(_source(module))
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        src = _absolute(node, module, hasattr(mod, '__path__'))
                        if not self.bundled(src):
                            return module, name
                        return self.resolve(src, a.name, depth + 1)
        return module, name

    def rewrite(self, module: str) -> str:
        src = _source(module)
        is_package = module not in SUBSTITUTES and hasattr(importlib.import_module(module), '__path__')
        tree = ast.parse(src)
        lines = src.splitlines()
        edits = []  # (first line, last line, replacement lines)
        in_function = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(fn):
                    if n is not fn:
                        in_function.add(id(n))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            indent = lines[node.lineno - 1][:node.col_offset]
            nested = id(node) in in_function
            if isinstance(node, ast.ImportFrom):
                target = _absolute(node, module, is_package)
                if self.bundled(target):
                    new = []
                    for a in node.names:
                        if a.name == '*':
                            raise BundleError(f"{module}: 'from {target} import *' cannot be bundled")
                        home, real = self.resolve(target, a.name)
                        alias = f' as {a.asname or a.name}' if (a.asname or a.name) != real else ''
                        new.append(f'{indent}from .{self.add(home)} import {real}{alias}')
                    edits.append((node.lineno, node.end_lineno, new))
                    continue
                tops = [target.split('.')[0]]
            else:
                tops = [a.name.split('.')[0] for a in node.names]
                if any(self.bundled(a.name) for a in node.names):
                    raise BundleError(f"{module}: 'import {node.names[0].name}' cannot be bundled; "
                                      f"use 'from ... import ...'")
            if all(t in ALLOWED_TOP or _stdlib(t) for t in tops):
                continue
            if not nested:
                raise BundleError(f"{module} imports {tops[0]!r} at module level; the exported code would "
                                  f"need it installed")
            # an optional package used inside a function (a GPU fast path): same behaviour, but
            # transformers does not demand the package when it loads the code
            body = lines[node.lineno - 1:node.end_lineno]
            body[0] = body[0][node.col_offset:]
            edits.append((node.lineno, node.end_lineno, [
                f'{indent}try:', *[f'{indent}    {b}' if i == 0 else f'    {b}' for i, b in enumerate(body)],
                f'{indent}except ImportError as e:',
                f'{indent}    raise ImportError("this path of the exported model needs {tops[0]!r} installed") from e',
            ]))
        for first, last, new in sorted(edits, reverse=True):
            lines[first - 1:last] = new
        header = f'# generated by flame.utils.remote_code from {module}; edits are lost at the next export\n'
        return header + '\n'.join(lines) + '\n'


ENTRY = 'modeling_flame_export'


def bundle(classes: dict[str, type], packages: tuple[str, ...] = ()) -> tuple[dict[str, str], dict[str, str]]:
    """Files (name -> source) for ``classes`` ({auto class name: class}) and the ``auto_map`` entries.

    ``packages``: extra top-level packages to copy (the model's own). Every ``auto_map`` entry
    points into one entry file that imports all the classes: transformers caches a remote module
    together with what it imports, so config and model classes taken from two files would come
    from two copies of the shared modules (and ``isinstance`` across them fails). Raises ``BundleError``.
    """
    b = Bundler(packages)
    auto_map, lines = {}, [f'"""Entry point of the exported modeling code (generated by flame.utils.remote_code)."""']
    for auto, cls in classes.items():
        home, real = b.resolve(cls.__module__, cls.__name__)
        lines.append(f'from .{b.add(home)} import {real}  # noqa: F401')
        auto_map[auto] = f'{ENTRY}.{real}'
    files = b.run()
    files[ENTRY + '.py'] = '\n'.join(lines) + '\n'
    return files, auto_map
