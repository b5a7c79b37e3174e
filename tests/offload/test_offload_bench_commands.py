"""benchmarks/offload.py's command lines are valid without a GPU: torchtitan's ConfigManager parses
every torchtitan row, flame's config manager every flame row; the torchtitan 3B/8B flavors have
the parameters of flame's configs (the same model on both sides); the parsers of the logs read
the lines the trainers write."""

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import offload as bench  # noqa: E402  (benchmarks/offload.py)


@pytest.fixture(scope="module")
def rows():
    return bench.all_rows(steps=8)


def test_rows_cover_both_frameworks_and_modes_at_the_same_tokens(rows):
    assert {(r.shape, r.framework, r.mode) for r in rows} == {
        (s, f, m) for s in ("3B", "8B") for f, m in (("flame", "offload"), ("torchtitan", "resident"),
                                                     ("torchtitan", "fsdp2_offload"))}
    for r in rows:
        opt = dict(zip(r.args[::2], r.args[1::2]))
        seq = int(opt["--training.seq_len"])
        seqs = int(opt["--training.batch_size"] if r.framework == "flame" else opt["--training.global_batch_size"])
        assert seq * seqs == bench.TOKENS_PER_STEP, r.name


def test_torchtitan_rows_parse_with_torchtitans_config_manager(rows, tmp_path):
    from torchtitan.config import ConfigManager

    for r in (r for r in rows if r.framework == "torchtitan"):
        argv = bench.command(r, str(tmp_path / r.name))[len(bench.launcher(r)):]
        cfg = ConfigManager().parse_args(argv)
        assert cfg.training.enable_cpu_offload == (r.mode == "fsdp2_offload")
        assert cfg.compile.enable and cfg.activation_checkpoint.mode == "full"
        assert cfg.experimental.custom_import == "benchmarks.titan_ext"
        assert cfg.training.global_batch_size % cfg.training.local_batch_size == 0


def test_flame_rows_parse_with_flames_config_manager(rows, tmp_path):
    from flame.config.manager import FlameConfigManager

    for r in (r for r in rows if r.framework == "flame"):
        argv = bench.command(r, str(tmp_path / r.name))[len(bench.launcher(r)):]
        cfg = FlameConfigManager().parse_args(argv)
        assert cfg.offload.enable == "on" and cfg.offload.gpu_memory_gib == bench.SHAPES[r.shape].cap_gib
        assert cfg.training.compile == ("_compile" in r.name)
        assert cfg.offload.speculative_step == ("_speculative" in r.name)
        assert cfg.training.max_norm == (0.0 if "_noclip" in r.name else 100.0 if "_maxnorm100" in r.name else 1.0)
        assert cfg.training.skip_nan_inf == ("_noskip" not in r.name)
        assert cfg.offload.checkpoint_offload == ("_checkpoint_offload" in r.name)
        threads = re.search(r"_t(\d+)$", r.name)
        assert cfg.offload.cpu_threads == (int(threads.group(1)) if threads else 0)


@pytest.mark.parametrize("shape", ["3B", "8B"])
def test_torchtitan_flavor_is_flames_config(shape):
    import torch
    from torchtitan.models import llama3

    import titan_ext  # noqa: F401  (registers the 3B flavor)
    from flame.models.build import load_model_config
    from flame.models.flops import param_counts

    with torch.device("meta"):
        model = llama3.Transformer(llama3.llama3_args[bench.SHAPES[shape].titan_flavor])
    titan = sum(p.numel() for p in model.parameters())
    flame = param_counts(load_model_config(os.path.join(ROOT, bench.SHAPES[shape].flame_config)))["total"]
    assert titan == flame


def test_log_parsers_read_the_trainers_lines():
    titan = ("\x1b[31mstep:  3  \x1b[32mloss:  9.12345  \x1b[38;2;180;60;0mgrad_norm:  1.2  "
             "\x1b[33mmemory: 62.80GiB(79.30%)  \x1b[34mtps: 15,322  \x1b[36mtflops: 300.1  mfu: 30.34%\x1b[39m")
    assert bench.titan_steps(titan) == [{"step": 3, "loss": 9.12345, "memory_peak_gib": 62.8,
                                         "tokens_per_second": 15322.0}]
    flame = ("offload calibration (steps 3-5 of this launch): step predicted 2.755 s, measured 3.07 s (+11%); "
             "peak GPU predicted 14.20 GiB, measured 14.80 GiB")
    assert bench.planner_report(flame) == {"predicted_step_s": 2.755, "calibration_step_s": 3.07,
                                           "predicted_peak_gib": 14.2, "measured_peak_allocated_gib": 14.8}
    # the planner's reserved prediction, where the line has it
    assert bench.planner_report(flame + " (allocated); reserved predicted 14.95 GiB")["predicted_peak_reserved_gib"] == 14.95


def test_list_mode_prints_every_row_without_a_gpu(capsys):
    assert bench.main(["--list", "--shapes", "3B"]) == 0
    out = capsys.readouterr().out
    assert "torchtitan.train" in out and "train.sh" in out and "--training.enable_cpu_offload" in out


def test_torchtitan_reads_the_registered_corpus():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    import titan_ext  # noqa: F401  (registers the dataset)

    tok = HuggingFaceTokenizer(bench.TOKENIZER)
    x, y = next(iter(HuggingFaceTextDataset("flame_sample", None, tok, seq_len=64, infinite=True)))
    assert x["input"].shape == y.shape == (64,) and int(x["input"].max()) < tok.get_vocab_size()
    assert (x["input"][1:] == y[:-1]).all()
