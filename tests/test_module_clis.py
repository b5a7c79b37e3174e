"""flame's ``python -m`` commands answer a bad argument as train.sh does: one ``flame: error:`` line
naming it, exit 2, no usage block."""
import importlib

import pytest

COMMANDS = ["flame.generate", "flame.utils.autotune", "flame.utils.preprocess", "flame.utils.convert_dcp_to_hf",
            "flame.utils.convert_hf_to_dcp", "flame.plot", "flame.ops.attention.tune"]


@pytest.mark.parametrize("module", COMMANDS)
def test_a_bad_argument_is_one_line(module, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as stop:
        main(["--no_such_option", "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("flame: error:") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, named", [
    (["--path", "x"], "--prompt"),                                            # a required option missing
    (["--path", "x", "--prompt", "hi", "--max_new_tokens", "abc"], "'abc'"),  # a value of the wrong type
])
def test_generate_s_argument_errors_name_the_option(argv, named, capsys):
    from flame.generate import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("flame: error:") and err.count("\n") == 1 and named in err, err


def test_autotune_without_a_command_is_one_line(capsys):
    from flame.utils.autotune import main

    with pytest.raises(SystemExit) as stop:
        main([])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("flame: error:") and err.count("\n") == 1, err
