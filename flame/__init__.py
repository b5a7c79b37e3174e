"""flame: LLM pretraining on torchtitan for FLA and Hugging Face models, with host offload.

Importing ``flame`` registers every model family it can train with transformers' Auto
classes: FLA's (``import fla``), flame's own transformer and the ``custom_models`` package,
so exported checkpoints load with ``AutoModelForCausalLM.from_pretrained`` after ``import flame``.
It changes nothing else: flame's CPU implementations of FLA's Triton ops
(``flame.models.cpu.enable_cpu_fallbacks``) and the Triton autotune limit
(``FLAME_AUTOTUNE_MAX_CONFIGS``) are applied by the code paths that need them: the trainer's
setup, ``flame.generate`` (``load`` and ``generate`` on CPU) and the offload planner's
measurements (the HF-to-DCP conversion installs only the flash-attn stand-ins it needs to build). Plain ``transformers`` code that runs an FLA model on CPU calls
``flame.models.cpu.enable_cpu_fallbacks(model)`` once.
"""

import importlib
import warnings

__version__ = "0.1.0"


def _register_model_families() -> None:
    # FLA warns on import on every machine without a Triton GPU backend; flame runs on CPU by
    # design (its own fallbacks), so that one message is noise in every command's output
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform",
                                category=UserWarning)
        import fla  # noqa: F401  (registers FLA's configs and models)

    # flame's transformer replaces FLA's "transformer" entry (which needs flash_attn)
    for name in ("flame.models.transformer", "custom_models"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise


_register_model_families()
