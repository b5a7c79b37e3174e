"""The command line as a new user meets it: the bundled job file as the base, paths from any
working directory, --help, one-line errors for wrong types, the calculator's help and profile."""

import json
import os
import subprocess

import pytest
import torch

from flame.config.manager import DEFAULT_TOML, PACKAGE_ROOT, FlameConfigManager
from flame.errors import ConfigError
from tests.trainer.helpers import ROOT, TINY_LLAMA

TINY = "configs/debug/transformer_tiny.json"  # bundled, relative to the checkout


def parse(*args):
    return FlameConfigManager().parse_args(list(args))


def test_default_job_file_is_the_base_without_config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # bundled paths work from anywhere
    cfg = parse("--model.config", TINY, "--training.steps", "20")
    assert cfg.job.config_file == DEFAULT_TOML
    # values only fla.toml sets (torchtitan's defaults differ: eps 1e-8, lr 8e-4, warmup 200)
    assert (cfg.optimizer.eps, cfg.optimizer.lr, cfg.lr_scheduler.warmup_steps) == (1e-15, 3e-4, 1024)
    assert cfg.training.steps == 20 and cfg.debug.seed == 42
    assert cfg.model.config == os.path.join(PACKAGE_ROOT, TINY)
    assert cfg.model.tokenizer_path == os.path.join(PACKAGE_ROOT, "flame/assets/tokenizer")
    assert cfg.training.dataset == os.path.join(PACKAGE_ROOT, "flame/assets/sample_corpus")
    assert cfg.job.dump_folder == "exp/default"  # outputs stay relative to the working directory
    # '' asks for no job file: torchtitan's and flame's own defaults
    bare = parse("--job.config_file", "", "--model.config", TINY)
    assert bare.optimizer.eps == 1e-8 and not bare.job.config_file


def test_job_file_paths_resolve_against_its_folder(tmp_path, monkeypatch):
    jobs = tmp_path / "project" / "jobs"
    (jobs / "data" / "a").mkdir(parents=True)
    (jobs / "data" / "b").mkdir()
    (jobs / "data" / "b" / "part-0.jsonl").write_text('{"text": "x"}\n')
    (jobs / "tok").mkdir()
    (jobs / "model.json").write_text(open(TINY_LLAMA).read())
    toml = jobs / "job.toml"
    toml.write_text(
        '[model]\nconfig = "model.json"\ntokenizer_path = "tok"\n'
        '[training]\ndataset = "data/a,HuggingFaceFW/fineweb-edu,data/b"\ndata_files = ",,data/b/*.jsonl"\n'
        '[validation]\nenable = true\ndataset = "flame/assets/sample_corpus"\n'
        '[job]\ndump_folder = "exp/run"\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = parse("--job.config_file", str(toml))
    assert cfg.model.config == str(jobs / "model.json")
    assert cfg.model.tokenizer_path == str(jobs / "tok")
    assert cfg.training.dataset == f"{jobs / 'data/a'},HuggingFaceFW/fineweb-edu,{jobs / 'data/b'}"
    assert cfg.training.data_files == f",,{jobs / 'data/b/*.jsonl'}"
    assert cfg.validation.dataset == os.path.join(PACKAGE_ROOT, "flame/assets/sample_corpus")  # bundled
    assert cfg.job.dump_folder == "exp/run"

    # a relative --job.config_file, and a CLI path relative to the working directory
    (elsewhere / "mine.json").write_text(open(TINY_LLAMA).read())
    cfg = parse("--job.config_file", os.path.relpath(toml), "--model.config", "mine.json")
    assert cfg.model.config == "mine.json" and cfg.model.tokenizer_path == str(jobs / "tok")
    with pytest.raises(ConfigError, match="model.config 'missing.json': no such file"):
        parse("--job.config_file", str(toml), "--model.config", "missing.json")


def test_a_leading_tilde_is_the_home_folder_in_every_path_option(tmp_path, monkeypatch):
    """A TOML value (or a quoted option) reaches flame with its ~ unexpanded: input and output
    paths take it as the home folder, as a shell would."""
    home = tmp_path / "home"
    (home / "tok").mkdir(parents=True)
    (home / "corpus").mkdir()
    (home / "model.json").write_text(open(TINY_LLAMA).read())
    monkeypatch.setenv("HOME", str(home))
    toml = tmp_path / "job.toml"
    toml.write_text('[model]\nconfig = "~/model.json"\ntokenizer_path = "~/tok"\n'
                    '[training]\ndataset = "~/corpus"\n[job]\ndump_folder = "~/runs/a"\n')
    cfg = parse("--job.config_file", str(toml), "--offload.save_plan", "~/plan.json",
                "--checkpoint.enable", "--checkpoint.initial_load_path", "~/tok")
    assert (cfg.model.config, cfg.model.tokenizer_path) == (str(home / "model.json"), str(home / "tok"))
    assert (cfg.training.dataset, cfg.job.dump_folder) == (str(home / "corpus"), str(home / "runs/a"))
    assert (cfg.offload.save_plan, cfg.checkpoint.initial_load_path) == (str(home / "plan.json"), str(home / "tok"))

@pytest.mark.parametrize("toml, fragment", [
    ('[training]\nsteps = "ten"\n', "training.steps = 'ten' in "),
    ("[training]\nvarlen = 1\n", "training.varlen = 1 in "),
    ('[lr_scheduler]\ndecay_type = "exp"\n', "expected one of linear, sqrt, cosine"),
    ("[optimizer]\nlr = true\n", "optimizer.lr = True in "),
    ('[training]\ndata_probs = "0.5,0.5"\n', "expected a list of numbers"),
    ('[training]\nseq_len = 1.5\n', "expected integer"),
])
def test_wrong_toml_type_is_one_line(tmp_path, toml, fragment):
    path = tmp_path / "job.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        parse("--job.config_file", str(path), "--model.config", TINY_LLAMA)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert str(path) in str(e.value)


def test_entry_point_exit_2_and_one_line(tmp_path, capsys):
    from flame.utils.dump_folder import main

    path = tmp_path / "job.toml"
    path.write_text('[training]\nsteps = "ten"\n')
    assert main(["--job.config_file", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flame: error: training.steps = 'ten'")
    # a flag given a value: one line, not tyro's box
    with pytest.raises(ConfigError, match="training.varlen is a flag"):
        parse("--model.config", TINY_LLAMA, "--training.varlen=False")


def _options_of(text: str) -> list[str]:
    return [line.split()[0] for line in text.splitlines() if line.startswith("  --")]


def test_help_lists_flame_options_once_with_descriptions(capsys):
    with pytest.raises(SystemExit) as e:
        parse("--help")
    assert e.value.code == 0
    text = capsys.readouterr().out
    options = _options_of(text)
    assert len(options) == len(set(options)), "an option listed twice"
    # torchtitan alone prints over 1,000 lines; flame's page stays a fraction of that (the [lora]
    # section, init_from, Muon and SFT options took it from 346 to 400 lines)
    assert len(text.splitlines()) < 450 and "DEPRECATED" not in text
    # one name per setting; options flame never reads are hidden
    for gone in ("--training.local_batch_size", "--validation.freq", "--debug.seed", "--compile.enable",
                 "--model.flavor", "--model.hf_assets_path", "--parallelism.pipeline_parallel_degree",
                 "--quantize.linear.float8.recipe_name", "--fault_tolerance.enable"):
        assert gone not in options
    for shown in ("--training.batch_size", "--validation.interval", "--training.seed", "--model.tokenizer_path",
                  "--model.config", "--offload.enable", "--probes.interval"):
        assert shown in options
    # every option flame defines carries the first line of its docstring; flame's values shown
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  --"):
            assert lines[i + 1].startswith("      "), f"no description: {line}"
    assert "Sequences per device per micro-batch (also --training.local_batch_size)" in text
    assert "--training.steps INT  [10000]" in text and "--optimizer.eps FLOAT  [1e-15]" in text


def test_help_shows_the_named_job_file_values(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[training]\nsteps = 77\n")
    text = FlameConfigManager().help_text(["--job.config_file", str(path)])
    assert "--training.steps INT  [77]" in text and str(path) in text


def test_help_shows_the_command_line_values_over_the_job_file():
    """``bash train.sh --help`` shows the default tiny job the launcher would run, not the bare
    fla.toml underneath it; options given with --help count too."""
    import subprocess
    import sys

    from flame.launch import default_job, job_args

    base = default_job()
    steps, model = base[base.index("--training.steps") + 1], base[base.index("--model.config") + 1]
    toml_steps = FlameConfigManager().base_config([]).training.steps
    assert steps != str(toml_steps)  # otherwise this test could not tell the two apart
    text = FlameConfigManager().help_text(job_args(["--help"]))
    assert f"--training.steps INT  [{steps}]" in text and f"--model.config STR  [{model}]" in text
    text = FlameConfigManager().help_text(job_args(["--training.steps", "7", "--help"]))
    assert "--training.steps INT  [7]" in text

    # through the launcher, as a user types it
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(ROOT, "train.sh"), "--training.steps", "7", "--help"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--training.steps INT  [7]" in proc.stdout and f"--model.config STR  [{model}]" in proc.stdout


def test_the_default_job_takes_varlen_as_it_is():
    """`bash train.sh --training.varlen`: the default job's context_len fits its seq_len (torchtitan's
    default context_len, 2048, is longer than the tiny job's sequences: a one-line error before)."""
    from flame.launch import job_args

    cfg = parse(*job_args(["--training.varlen"]))
    assert cfg.training.varlen and 1 <= cfg.training.context_len <= cfg.training.seq_len


def test_help_into_a_closed_pipe_exits_0(monkeypatch):
    """`python -m flame.train --help | head`: the reader closing the pipe is no traceback."""
    from flame.offload import calculator as plan

    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as after `head` has read its lines
    with os.fdopen(write_end, "w") as closed_pipe:
        monkeypatch.setattr("sys.stdout", closed_pipe)
        with pytest.raises(SystemExit) as e:
            parse("--help")
        assert e.value.code == 0
        assert plan.main(["--help"]) == 0


def test_plan_help_describes_the_calculator(capsys):
    from flame.offload import calculator as plan

    assert plan.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "resource calculator" in text and len(text.splitlines()) < 150
    options = _options_of(text)
    assert "--offload.gpu_memory_gib" in options and "--training.batch_size" in options
    assert "--training.steps" not in options and "--metrics.log_freq" not in options


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without a GPU")
def test_plan_without_gpu_uses_the_bundled_profile(tmp_path, capsys):
    from flame.offload import calculator as plan

    assert plan.BUNDLED_PROFILES, "flame ships a measured profile"
    rc = plan.main(["--model.config", TINY_LLAMA, "--training.batch_size", "2", "--training.seq_len", "64",
                    "--job.dump_folder", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    notes = [line for line in out.splitlines() if "bundled measured profile" in line]
    assert len(notes) == 1 and plan.BUNDLED_PROFILES[0] in notes[0]
    assert "offload plan:" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the docs' output is the one of a machine without a GPU")
def test_the_docs_calculator_example_prints_what_the_docs_show(tmp_path, monkeypatch, capsys):
    """docs/offload.md's LoRA example (`$ python -m flame.offload.plan ...` and its output): the
    docs showed an older output (no reserved peak, no `recomputed with inputs on the host`)."""
    import re
    import shlex

    from flame.offload import calculator as plan

    text = open(os.path.join(ROOT, "docs/offload.md")).read()
    block = re.search(r"```\n\$ (python -m flame.offload.plan .*?)```", text, re.S).group(1)
    lines = block.replace("\\\n", " ").splitlines()
    args = shlex.split(lines[0])[3:]
    monkeypatch.chdir(ROOT)  # the command's relative paths, as the docs run it from the checkout
    assert plan.main(args + ["--job.dump_folder", str(tmp_path)]) == 0
    out = capsys.readouterr().out.replace(ROOT, "<repo>")
    assert out.splitlines() == lines[1:]


def test_plan_help_shows_the_job_it_plans(capsys):
    """``python -m flame.offload.plan --help`` shows the values of the job it would plan: train.sh's
    default tiny job (not fla.toml underneath it), with the command line's options on top."""
    from flame.launch import default_job
    from flame.offload.calculator import main

    base = default_job()
    model, seq = base[base.index("--model.config") + 1], base[base.index("--training.seq_len") + 1]
    assert seq != str(FlameConfigManager().base_config([]).training.seq_len)
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert f"--model.config STR  [{model}]" in out and f"--training.seq_len INT  [{seq}]" in out
    assert main(["--training.seq_len", "512", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--training.seq_len INT  [512]" in out
    # the options it reads beyond offload's and the shape (docs/offload.md's LoRA example uses --lora.rank)
    for option in ("--lora.rank", "--lora.targets", "--job.dump_folder", "--training.compile",
                   "--training.tensor_parallel_degree"):
        assert f"\n  {option} " in out, option


def test_launch_config_check_parses_without_importing_fla(tmp_path):
    """train.sh's check before any process starts parses the whole command line (bad values are
    one-line errors there) without flame's model registration, which imports FLA and Triton."""
    import subprocess
    import sys

    from flame.launch import CONFIG_CHECK

    probe = CONFIG_CHECK.replace("sys.exit(main(sys.argv[1:]))", "rc = main(sys.argv[1:]); print('fla' in sys.modules, rc)")
    assert probe != CONFIG_CHECK
    env = dict(os.environ, PYTHONPATH=ROOT)
    dump = str(tmp_path / "run")
    out = subprocess.run([sys.executable, "-c", probe, "--job.dump_folder", dump, "--training.steps", "3"],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == [dump, "False", "0"], out.stdout + out.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-c", CONFIG_CHECK, "--training.steps", "0"],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("flame: error: training.steps 0"), bad.stderr[-2000:]
    # flame's kernel variables are checked there too, also on a machine where no kernel reads them
    bad_env = subprocess.run([sys.executable, "-c", CONFIG_CHECK, "--training.steps", "3"], cwd=str(tmp_path),
                             env=dict(env, FLAME_VARLEN_SOFTMAX="flash"), capture_output=True, text=True, timeout=120)
    assert bad_env.returncode == 2, bad_env.stderr[-2000:]
    assert bad_env.stderr == "flame: error: FLAME_VARLEN_SOFTMAX='flash': expected one of varlen, flex\n"


def test_a_model_module_in_the_working_directory_reaches_the_workers(tmp_path):
    """custom_models/README.md's walkthrough: train.sh run from the folder of the user's package,
    with no PYTHONPATH of theirs; the rank (started by torchrun from a script path) imports it."""
    from tests.trainer.helpers import JOB_ENV, tiny_job

    marks = tmp_path / "imported_by"
    (tmp_path / "cwd_marker.py").write_text(
        "import os\nwith open(os.environ['MARKS'], 'a') as f:\n    f.write(os.environ.get('RANK', '-') + '\\n')\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", MARKS=str(marks), NGPU="1")
    env["PYTHONPATH"] = JOB_ENV["PYTHONPATH"]  # flame's own paths only: the user's folder is the working directory
    proc = subprocess.run(["bash", os.path.join(ROOT, "train.sh"),
                           *tiny_job(str(tmp_path / "run"), "--training.steps", "1", "--model.module", "cwd_marker",
                                     "--checkpoint.no-enable")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0" in marks.read_text().split()  # imported by rank 0


def test_plan_replayed_for_another_block_count_is_an_error(tmp_path, capsys):
    """The calculator replayed a plan made for another number of blocks and exited 0; the trainer's
    engine refused it after building the model. Both now name the counts, before any build."""
    import json

    from flame.offload import calculator as plan

    profile = os.path.join(ROOT, "flame/offload/profiles/h100_80gb_measured.json")
    common = ["--training.batch_size", "2", "--training.seq_len", "64", "--offload.enable", "on",
              "--offload.profile", profile, "--offload.host_memory_gib", "8"]
    saved = str(tmp_path / "plan.json")
    assert plan.main(["--model.config", TINY_LLAMA, *common, "--offload.save_plan", saved]) == 0
    fewer = tmp_path / "one_layer.json"
    fewer.write_text(json.dumps(dict(json.load(open(TINY_LLAMA)), num_hidden_layers=1)))
    capsys.readouterr()
    assert plan.main(["--model.config", str(fewer), *common, "--offload.plan", saved]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "made for 2 blocks, the model has 1" in err[0], err
    # as many blocks of another size: replayed in silence on the other model before
    wider = tmp_path / "wider.json"
    wider.write_text(json.dumps(dict(json.load(open(TINY_LLAMA)), intermediate_size=256)))
    assert plan.main(["--model.config", str(wider), *common, "--offload.plan", saved]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "made for another model (block 0 of " in err[0] and "model.config" in err[0], err
    assert plan.main(["--model.config", TINY_LLAMA, *common, "--offload.plan", saved]) == 0
    # --offload.save_plan beside a replayed plan was dropped in silence (no file written)
    again = tmp_path / "again.json"
    assert plan.main(["--model.config", TINY_LLAMA, *common, "--offload.plan", saved, "--offload.save_plan",
                      str(again)]) == 0
    assert json.loads(again.read_text()) == json.load(open(saved))


def test_help_describes_validation_steps_as_flame_reads_it(capsys):
    """--help used to show torchtitan's text ('-1 means consuming all the data in the validation
    dataset WARNING: ... hangs'), while flame evaluates one batch at -1 (docs/data.md)."""
    with pytest.raises(SystemExit):
        parse("--help")
    lines = capsys.readouterr().out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("  --validation.steps "))
    assert lines[i].split() == ["--validation.steps", "INT", "[-1]"]
    assert lines[i + 1].strip().startswith("Validation batches per evaluation; -1 (the default): one batch")
    assert "consuming all" not in lines[i + 1] + lines[i + 2]
