"""Sample text from a training run or a Hugging Face folder.

    python -m flame.generate --path DUMP|HF_DIR --prompt "def main" [--max_new_tokens 64]
        [--temperature 0.8] [--top_p 0.95] [--seed 0] [--step N] [--device cpu|cuda] [--dtype float32]

``--path`` is either a model folder (config.json + weights, e.g. ``DUMP/hf``), or a dump folder:
then the weights come from ``DUMP/checkpoint/step-N`` (``--step``, default the latest step),
loaded into the model the run built (its ``job_config.json``: model config, ``model.module``,
vocabulary raised to the tokenizer), or from ``DUMP/hf`` when the run kept no checkpoint.
``--temperature 0`` is greedy decoding. Bad input: one line on stderr, exit status 2.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from flame.errors import ConfigError
from flame.utils.cli import CliParser


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog='python -m flame.generate', description=__doc__.splitlines()[0])
    p.add_argument('--path', required=True, help='dump folder of a run, or a Hugging Face model folder')
    p.add_argument('--prompt', required=True, help='text to continue')
    p.add_argument('--max_new_tokens', '--max-new-tokens', type=int, default=64, help='tokens to sample (default 64)')
    p.add_argument('--temperature', type=float, default=0.8, help='sampling temperature; 0 = greedy (default 0.8)')
    p.add_argument('--top_p', '--top-p', type=float, default=0.95, help='nucleus sampling mass (default 0.95)')
    p.add_argument('--seed', type=int, default=0, help='random seed (default 0)')
    p.add_argument('--step', type=int, help='checkpoint step of a dump folder (default: the latest)')
    p.add_argument('--device', help='cpu or cuda (default: cuda when available)')
    p.add_argument('--dtype', default='float32', help='float32 (default), bfloat16 or float16')
    return p


def _steps(dump: str) -> list[int]:
    folder = os.path.join(dump, 'checkpoint')
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for d in os.listdir(folder) if (m := re.fullmatch(r'step-(\d+)', d))
                  and os.path.isfile(os.path.join(folder, d, '.metadata')))


def _from_checkpoint(dump: str, step: int | None, dtype):
    """The run's model with the weights of ``DUMP/checkpoint/step-N`` (model keys only are read)."""
    import torch
    from transformers import AutoModelForCausalLM

    from flame.utils.hf_export import _dcp_metadata, _check_against_metadata, _read_from_dcp, model_keys, run_model_config
    steps = _steps(dump)
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"no checkpoint step-{step} in {os.path.join(dump, 'checkpoint')!r} "
                          f"(steps: {', '.join(map(str, steps)) or 'none'})")
    ckpt = os.path.join(dump, 'checkpoint', f'step-{step}')
    config, tokenizer = run_model_config(dump)
    if not tokenizer:
        raise ConfigError(f"{os.path.join(dump, 'job_config.json')!r} names no model.tokenizer_path")
    keys = model_keys(config)
    metadata = _dcp_metadata(ckpt)
    _check_against_metadata(keys, metadata, ckpt)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = _read_from_dcp(ckpt, list(keys), metadata)
    # ``keys`` is every tensor of this model once: only tied aliases (lm_head) are left out
    model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype), tokenizer, f'{ckpt}'


def load(path: str, step: int | None = None, dtype: str = 'float32'):
    """(model, tokenizer, description of what was loaded) for ``--path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flame.utils.hf_export import parse_dtype, register_families
    dtype = parse_dtype(dtype)
    if not os.path.isdir(path):
        raise ConfigError(f"--path {path!r} is not a folder")
    register_families()
    from flame.models.cpu import enable_cpu_fallbacks
    enable_cpu_fallbacks()  # before the constructors: FLA layers bind some functions at construction
    from flame.components.init_from import is_dump_folder, refuse_adapter_folder
    is_dump = is_dump_folder(path)
    if is_dump and (_steps(path) or step is not None):
        model, tokenizer, what = _from_checkpoint(path, step, dtype)
        return model, AutoTokenizer.from_pretrained(tokenizer), what
    folder = os.path.join(path, 'hf') if is_dump else path
    refuse_adapter_folder(folder, '--path')
    if not os.path.isfile(os.path.join(folder, 'config.json')):
        hint = 'no checkpoint and no hf export' if is_dump else 'no config.json'
        raise ConfigError(f"--path {path!r} is neither a dump folder with checkpoints nor a model folder ({hint})")
    if is_dump:
        from flame.models.registry import import_model_modules
        from flame.utils.hf_export import resolve_job_config
        import_model_modules(resolve_job_config(path).get('module'))
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot load the model in {folder!r}: {str(e).strip().splitlines()[0]}") from None
    return model, tokenizer, folder


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens {max_new_tokens} must be at least 1")
    if temperature < 0:
        raise ConfigError(f"--temperature {temperature} must be >= 0")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top_p {top_p} must be in (0, 1]")


def resolve_device(device: str | None) -> str:
    """``device``, or cuda where there is one and cpu otherwise; one that cannot run is a ConfigError."""
    import torch

    device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    if device not in ('cpu', 'cuda') and not device.startswith('cuda:'):
        raise ConfigError(f"--device {device!r} is not cpu or cuda")
    if device.startswith('cuda') and not torch.cuda.is_available():
        raise ConfigError(f"--device {device!r}: no CUDA device here")
    return device


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8,
             top_p: float = 0.95, seed: int = 0, device: str | None = None) -> str:
    """The prompt followed by the sampled continuation (decoded text)."""
    import torch

    check_sampling(max_new_tokens, temperature, top_p)
    device = resolve_device(device)
    if device == 'cpu':
        from flame.models.cpu import enable_cpu_fallbacks
        enable_cpu_fallbacks(model)  # FLA's ops are Triton-only; a model built before also needs its instances
    model = model.to(device).eval()
    ids = tokenizer(prompt, return_tensors='pt').input_ids.to(device)
    if ids.shape[1] == 0:
        ids = torch.tensor([[tokenizer.bos_token_id or 0]], device=device)
    torch.manual_seed(seed)
    kwargs = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
                             if tokenizer.pad_token_id is not None else tokenizer.eos_token_id, **kwargs)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from flame.utils.autotune import prepare_triton_autotune

        # checked before the model loads: a bad option is one line, not a load's output and then a line
        check_sampling(args.max_new_tokens, args.temperature, args.top_p)
        device = resolve_device(args.device)
        prepare_triton_autotune('cuda' if device.startswith('cuda') else 'cpu')
        model, tokenizer, what = load(args.path, args.step, args.dtype)
        text = generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_p,
                        args.seed, device)
    except ConfigError as e:
        print(f"flame: error: {e}", file=sys.stderr)
        return 2
    print(f"# {what}", file=sys.stderr)
    print(text)
    return 0


if __name__ == '__main__':
    sys.exit(main())
