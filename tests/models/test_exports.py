"""Exports anyone can load: Llama-equivalent transformers as LlamaForCausalLM, FLA families under FLA's
model types, everything else with its modeling code; umask; a model from a package outside the tree;
sampling with python -m flame.generate."""
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from models_testlib import DEBUG_DIR, ROOT, debug_config
from tests.trainer.helpers import free_port

TOKENIZER = os.path.join(ROOT, 'flame', 'assets', 'tokenizer')
TOML = os.path.join(ROOT, 'flame', 'models', 'fla.toml')
CORPUS = os.path.join(ROOT, 'flame', 'assets', 'sample_corpus')


def _transformer(seed=0, **overrides):
    """flame's tiny transformer with random (not freshly initialized: norms != 1) float32 weights."""
    import flame  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(os.path.join(DEBUG_DIR, 'transformer_tiny.json'), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_llama_equivalence_is_decided_feature_by_feature():
    from flame.utils.export_llama import llama_mismatches
    assert llama_mismatches(_transformer().config) == []
    for override in ({'attn_impl': 'naive_softpick'}, {'attn_impl': 'scaled'}, {'qk_norm': True},
                     {'qkv_bias': True}, {'window_size': 16}, {'rope_theta': None},
                     {'elementwise_affine': False}):
        assert llama_mismatches(_transformer(**override).config), override
    # every plain-softmax implementation computes the same attention
    assert llama_mismatches(_transformer(attn_impl=['naive', 'flex']).config) == []


def test_transformer_exports_as_llama_with_equal_logits_and_umask(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from flame.utils.hf_export import export_hf
    model = _transformer(rope_theta=5e4, norm_eps=1e-5)
    old = os.umask(0o027)
    try:
        out = export_hf(model.state_dict(), model.config, TOKENIZER, str(tmp_path / 'llama'), dtype='float32')
    finally:
        os.umask(old)
    assert os.stat(out).st_mode & 0o777 == 0o750
    assert {os.stat(os.path.join(out, f)).st_mode & 0o777 for f in os.listdir(out)} == {0o640}
    assert json.load(open(os.path.join(out, 'config.json')))['model_type'] == 'llama'
    llama = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(llama) is LlamaForCausalLM
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
        a = llama.generate(ids[:1, :6], max_new_tokens=6, do_sample=False)
        b = model.generate(ids[:1, :6], max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


LOADER = textwrap.dedent('''
    import importlib.abc, os, sys, torch
    blocked = {"flame", "custom_models", "fla", "triton"}
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in blocked:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
    sys.meta_path.insert(0, Block())
    # the checkout itself off the path (a virtual environment inside it stays)
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.abspath(sys.argv[1])]
    from transformers import AutoModelForCausalLM
    remote, fla_dir, ids_file, out_file = sys.argv[2:]
    ids = torch.load(ids_file)
    m = AutoModelForCausalLM.from_pretrained(remote, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = m(ids).logits
        gen = m.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert not [k for k in sys.modules if k.split(".")[0] in blocked]
    blocked -= {"fla", "triton"}
    import fla
    g = AutoModelForCausalLM.from_pretrained(fla_dir)
    assert type(g).__module__.startswith("fla."), type(g)
    assert not [k for k in sys.modules if k.split(".")[0] in ("flame", "custom_models")]
    torch.save({"logits": logits, "gen": gen, "fla": g.state_dict()}, out_file)
''')


@pytest.mark.slow
def test_remote_code_and_fla_exports_load_without_flame(tmp_path):
    """softpick + qk-norm transformer: its code in the folder, loaded where flame and FLA cannot be
    imported, logits equal flame's; a GLA export loads with only ``import fla``."""
    from transformers import AutoModelForCausalLM
    from flame.utils.hf_export import export_hf
    model = _transformer(attn_impl='naive_softpick', qk_norm=True)
    remote = export_hf(model.state_dict(), model.config, None, str(tmp_path / 'softpick'), dtype='float32')
    assert 'auto_map' in json.load(open(os.path.join(remote, 'config.json')))
    gla = AutoModelForCausalLM.from_config(debug_config('gla'), dtype=torch.float32)
    fla_dir = export_hf(gla.state_dict(), gla.config, None, str(tmp_path / 'gla'), dtype='float32')
    assert json.load(open(os.path.join(fla_dir, 'config.json')))['architectures'] == ['GLAForCausalLM']
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    torch.save(ids, tmp_path / 'ids.pt')
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    env['HF_MODULES_CACHE'] = str(tmp_path / 'hf_modules')
    proc = subprocess.run([sys.executable, '-c', LOADER, ROOT, remote, fla_dir, str(tmp_path / 'ids.pt'),
                           str(tmp_path / 'out.pt')], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / 'out.pt')
    with torch.no_grad():
        torch.testing.assert_close(got['logits'], model(ids).logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(got['gen'], model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False))
    for k, v in gla.state_dict().items():
        assert torch.equal(got['fla'][k], v), k


GENERATE_ON_CPU = textwrap.dedent('''
    import json
    import sys
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    import flame
    from flame.generate import generate, load
    export, config, tokenizer = sys.argv[1:4]
    # a model built before anything was patched (mamba copies its activation into each layer at
    # construction): generate() rebinds the instances too
    config = AutoConfig.from_pretrained(config, vocab_size=len(AutoTokenizer.from_pretrained(tokenizer)))
    built = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loaded, tok, _ = load(export)
    for model in (built, loaded):
        print("generated:", json.dumps(generate(model, tok, "the", max_new_tokens=3, temperature=0, device="cpu")))
''')


def test_fla_model_generates_on_cpu_through_flame_generate(tmp_path):
    """A fresh process: ``import flame`` then flame.generate's public API, with no enable call:
    ``load`` and ``generate`` install the CPU dispatchers themselves."""
    from flame.utils.hf_export import export_hf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    config = debug_config('gla')
    config.vocab_size = len(tokenizer)
    gla = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fla_dir = export_hf(gla.state_dict(), gla.config, tokenizer,
                        str(tmp_path / 'gla'), dtype='float32')
    proc = subprocess.run([sys.executable, '-c', GENERATE_ON_CPU, fla_dir, os.path.join(DEBUG_DIR, 'mamba.json'),
                           TOKENIZER], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a random model's text: any characters, quotes included
    texts = [json.loads(line[len("generated: "):]) for line in proc.stdout.splitlines() if line.startswith("generated: ")]
    assert len(texts) == 2 and all(t.startswith("the") for t in texts), proc.stdout


def _readme_files(folder):
    """The files of custom_models/README.md's example, written into ``folder``."""
    text = open(os.path.join(ROOT, 'custom_models', 'README.md')).read()
    blocks = re.findall(r'```(?:python|json)\n(.*?)```', text, flags=re.S)
    written = []
    for block in blocks:
        first, body = block.split('\n', 1)
        name = re.fullmatch(r'(?:#|//) (\S+)', first.strip()).group(1)
        os.makedirs(os.path.join(folder, os.path.dirname(name)), exist_ok=True)
        with open(os.path.join(folder, name), 'w') as f:
            f.write(body)
        written.append(name)
    return written


@pytest.mark.slow
def test_custom_model_from_a_temporary_package(tmp_path):
    """custom_models/README.md's example, in a temporary folder, trained 2 steps from there; its
    export loads here, where its package cannot be imported."""
    from transformers import AutoModelForCausalLM
    proj = tmp_path / 'myproj'
    assert set(_readme_files(proj)) == {'my_models/tiny_lm.py', 'my_models/__init__.py', 'tiny_lm.json'}
    dump = tmp_path / 'dump'
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '1', '--master_port', str(free_port()),
           '-m', 'flame.train', '--job.config_file', TOML, '--job.dump_folder', str(dump),
           '--model.module', 'my_models', '--model.config', 'tiny_lm.json', '--model.tokenizer_path', TOKENIZER,
           '--training.dataset', CORPUS, '--training.steps', '2', '--training.batch_size', '2',
           '--training.seq_len', '32', '--training.num_workers', '0', '--training.mixed_precision_param', 'float32',
           '--metrics.log_freq', '1', '--checkpoint.no-enable-checkpoint', '--checkpoint.export-hf',
           '--checkpoint.export_dtype', 'float32', '--offload.enable', 'off']
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get('PYTHONPATH')) if p))
    proc = subprocess.run(cmd, cwd=proj, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    steps = [json.loads(line)['step'] for line in open(dump / 'metrics.jsonl')]
    assert max(steps) == 2
    assert 'my_models' not in sys.modules
    hf = AutoModelForCausalLM.from_pretrained(str(dump / 'hf'), trust_remote_code=True)
    assert type(hf).__name__ == 'TinyLMForCausalLM' and hf.config.vocab_size == 8192
    assert torch.isfinite(hf(torch.tensor([[1, 2, 3]])).logits).all()


def test_generate_from_dump_and_hf_folder(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoTokenizer
    from flame.generate import main
    from flame.utils.hf_export import export_hf
    model = _transformer(seed=3)
    dump = tmp_path / 'run'
    dcp.save(dict(model.state_dict()), checkpoint_id=str(dump / 'checkpoint' / 'step-4'))
    with open(dump / 'job_config.json', 'w') as f:
        json.dump({'model': {'config': os.path.join(DEBUG_DIR, 'transformer_tiny.json'),
                             'tokenizer_path': TOKENIZER, 'vocab_multiple': 64}}, f)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    ids = tok('def main', return_tensors='pt').input_ids
    with torch.no_grad():
        want = tok.decode(model.generate(ids, max_new_tokens=5, do_sample=False)[0], skip_special_tokens=True)
    args = ['--prompt', 'def main', '--max_new_tokens', '5', '--temperature', '0', '--device', 'cpu']
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter('always')
        assert main(['--path', str(dump), *args]) == 0
    assert not [w for w in seen if 'torch.distributed is disabled' in str(w.message)]  # DCP's single-process note
    assert capsys.readouterr().out.strip() == want.strip()
    hf = export_hf(model.state_dict(), model.config, TOKENIZER, str(tmp_path / 'hf'), dtype='float32')
    assert main(['--path', hf, *args]) == 0
    assert capsys.readouterr().out.strip() == want.strip()
    assert main(['--path', hf, '--prompt', 'x', '--max_new_tokens', '4', '--temperature', '0.9', '--seed', '1']) == 0
    capsys.readouterr()
    adapter = tmp_path / 'hf_adapter'
    adapter.mkdir()
    (adapter / 'adapter_config.json').write_text('{"peft_type": "LORA"}')
    for bad in (['--path', str(tmp_path / 'nope')], ['--path', str(dump), '--step', '9'],
                ['--path', str(tmp_path)], ['--path', str(adapter)]):
        assert main([*bad, '--prompt', 'x']) == 2
        err = capsys.readouterr().err
        assert err.startswith('flame: error:') and err.count('\n') == 1, err
    # sampling options are checked before the model loads: only their line, nothing of a load before it
    for bad, named in ((['--temperature', '-1'], '--temperature -1'), (['--top_p', '0'], '--top_p 0'),
                       (['--max_new_tokens', '-3'], '--max_new_tokens -3'), (['--device', 'tpu'], "'tpu'")):
        assert main(['--path', str(dump), '--prompt', 'x', *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith('flame: error:') and err.count('\n') == 1 and named in err, err
