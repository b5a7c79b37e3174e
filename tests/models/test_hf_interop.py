"""HF <-> DCP conversion: round trips, torchtitan's checkpoint layout, sharding, bad input."""
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from models_testlib import DEBUG_DIR, ROOT

TOKENIZER = os.path.join(ROOT, 'flame', 'assets', 'tokenizer')


def _llama(seed=0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(os.path.join(DEBUG_DIR, 'llama.json'), **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp('hf0') / 'llama'
    model = _llama()
    model.save_pretrained(d)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(d)
    return str(d), model


@pytest.fixture(scope='module')
def training_dump(tmp_path_factory):
    """A dump folder laid out like a torchtitan run: model keys flattened at the top level of the
    DCP state next to 'optimizer' and 'train_state', plus the job_config.json flame writes. As in a
    real run, the vocabulary of the config (256) was raised to the tokenizer's (8192)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torchtitan.components.checkpoint import ModelWrapper
    dump = tmp_path_factory.mktemp('dump')
    model = _llama(seed=1, vocab_size=8192)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    state = dict(ModelWrapper(model).state_dict())
    state['optimizer'] = get_optimizer_state_dict(model, opt)
    state['train_state'] = {'step': 5}
    dcp.save(state, checkpoint_id=str(dump / 'checkpoint' / 'step-5'))
    with open(dump / 'job_config.json', 'w') as f:
        json.dump({'model': {'config': os.path.join(DEBUG_DIR, 'llama.json'), 'tokenizer_path': TOKENIZER,
                             'vocab_multiple': 64}}, f)
    return str(dump), model


def test_dcp_to_hf_reads_only_model_keys_and_generates(training_dump, monkeypatch):
    from transformers import AutoModelForCausalLM
    import flame.utils.hf_export as hx
    from flame.utils.convert_dcp_to_hf import main
    dump, model = training_dump
    requested = []
    real_load = dcp.load
    monkeypatch.setattr(dcp, 'load', lambda sd, **kw: (requested.extend(sd), real_load(sd, **kw))[1])
    assert main(['--path', dump, '--step', '5', '--dtype', 'float32']) == 0
    meta = hx._dcp_metadata(os.path.join(dump, 'checkpoint', 'step-5'))
    assert any(k.startswith('optimizer.') for k in meta)  # the checkpoint has optimizer state ...
    assert sorted(requested) == sorted(model.state_dict())  # ... which was never read
    out = os.path.join(dump, 'hf_steps', 'step-5')
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    _same_weights(model, reloaded)
    assert os.path.isfile(os.path.join(out, 'tokenizer.json'))
    gen = reloaded.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 7)


def test_hf_to_dcp_loads_through_torchtitan_model_wrapper(hf_dir, tmp_path):
    from torchtitan.components.checkpoint import ModelWrapper
    from flame.utils.convert_hf_to_dcp import main
    src, model = hf_dir
    step0 = tmp_path / 'checkpoint' / 'step-0'
    assert main(['--model', src, '--checkpoint', str(step0)]) == 0
    # what CheckpointManager.load does for step 0 (model only): load ModelWrapper's keys, then set them
    fresh = _llama(seed=2)
    wrapper = ModelWrapper(fresh)
    sd = wrapper.state_dict()
    dcp.load(sd, checkpoint_id=str(step0))
    wrapper.load_state_dict(sd)
    _same_weights(model, fresh)


@pytest.mark.parametrize('change', [{'num_hidden_layers': 3}, {'num_hidden_layers': 1}, {'intermediate_size': 96}])
def test_hf_to_dcp_refuses_weights_that_do_not_match_the_config(hf_dir, tmp_path, capsys, change):
    """from_pretrained initializes missing or mis-shaped tensors at random and drops extra ones: the
    converter would write a checkpoint that is not the model's weights."""
    import shutil
    from flame.utils.convert_hf_to_dcp import main
    src, _ = hf_dir
    other = tmp_path / 'other'
    shutil.copytree(src, other)
    config = json.load(open(other / 'config.json'))
    (other / 'config.json').write_text(json.dumps(dict(config, **change)))
    capsys.readouterr()
    assert main(['--model', str(other), '--checkpoint', str(tmp_path / 'step-0')]) == 2
    err = capsys.readouterr().err
    assert err.startswith('flame: error:') and err.count('\n') == 1, err
    assert 'config.json and the weights disagree' in err and 'model.layers.' in err, err
    assert not (tmp_path / 'step-0').exists()


def test_round_trip_hf_dcp_hf_is_identical_and_shards(hf_dir, tmp_path):
    from safetensors.torch import load_file
    from flame.utils.hf_export import export_hf, hf_to_dcp
    src, model = hf_dir
    hf_to_dcp(src, str(tmp_path / 'ckpt'))
    out = export_hf(str(tmp_path / 'ckpt'), src, None, str(tmp_path / 'hf1'), dtype='float32',
                    max_shard_size='100KB')
    index = json.load(open(os.path.join(out, 'model.safetensors.index.json')))
    files = sorted(set(index['weight_map'].values()))
    assert len(files) > 1
    exported = {}
    for f in files:
        exported.update(load_file(os.path.join(out, f)))
    ref = load_file(os.path.join(src, 'model.safetensors'))
    assert exported.keys() == ref.keys()
    for k in ref:
        assert torch.equal(exported[k], ref[k]), k


def test_bf16_export_and_tied_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM
    from flame.utils.hf_export import export_hf
    model = _llama(tie_word_embeddings=True)
    out = export_hf(model.state_dict(), model.config, None, str(tmp_path / 'tied'), dtype='bfloat16')
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.tie_word_embeddings
    assert reloaded.lm_head.weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()
    assert reloaded.dtype == torch.bfloat16
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


def test_fla_model_exports_and_reloads(cpu_fallbacks, tmp_path):
    from transformers import AutoModelForCausalLM
    from models_testlib import debug_config
    from flame.utils.hf_export import export_hf
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(debug_config('gated_deltanet'), dtype=torch.float32).eval()
    out = export_hf(model.state_dict(), model.config, None, str(tmp_path / 'gdn'), dtype='float32')
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_bad_input_one_line_error_and_no_output(training_dump, tmp_path, capsys):
    from flame.utils.convert_dcp_to_hf import main
    dump, _ = training_dump
    out = tmp_path / 'bad'
    # a config that does not match the checkpoint
    rc = main(['--path', dump, '--step', '5', '--config', os.path.join(DEBUG_DIR, 'qwen3.json'), '--out', str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith('flame: error:') and err.count('\n') == 1
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith('.bad')]
    # a config with fewer layers than the checkpoint: its tensors are all there, the checkpoint has more
    fewer = tmp_path / 'one_layer.json'
    fewer.write_text(json.dumps(dict(json.load(open(os.path.join(DEBUG_DIR, 'llama.json'))), num_hidden_layers=1)))
    rc = main(['--path', dump, '--step', '5', '--config', str(fewer), '--out', str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count('\n') == 1 and "this config lacks, e.g. 'model.layers.1." in err, err
    assert not out.exists()
    # a tokenizer folder that does not exist: named as such (it was "Repo id must use alphanumeric
    # chars ...", from a hub look-up)
    assert main(['--path', dump, '--step', '5', '--tokenizer', str(tmp_path / 'no_tok'), '--out', str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"flame: error: tokenizer {str(tmp_path / 'no_tok')!r}: no such folder\n" and not out.exists()
    # a step that does not exist
    assert main(['--path', dump, '--step', '7', '--out', str(out)]) == 2
    assert 'step-7' in capsys.readouterr().err
    # no job_config.json and no --config
    os.makedirs(tmp_path / 'nojob' / 'checkpoint' / 'step-1')
    assert main(['--path', str(tmp_path / 'nojob'), '--step', '1']) == 2
    assert '--config' in capsys.readouterr().err
    # an output folder that is not empty is not clobbered
    os.makedirs(out)
    (out / 'keep.txt').write_text('x')
    assert main(['--path', dump, '--step', '5', '--out', str(out)]) == 2
    assert (out / 'keep.txt').read_text() == 'x'
    assert 'not empty' in capsys.readouterr().err
