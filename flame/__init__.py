"""flame: LLM pretraining on torchtitan for FLA and Hugging Face models, with host offload.

Importing ``flame`` registers every model family it can train with transformers' Auto
classes: FLA's (``import fla``), flame's own transformer and the ``custom_models`` package,
so exported checkpoints load with ``AutoModelForCausalLM.from_pretrained`` after ``import flame``.
It also installs flame's CPU dispatchers into FLA (``flame.models.cpu``): calls on CPU tensors take
flame's torch code, calls on any other device reach FLA's original function unchanged, so FLA
models train and ``generate`` on CPU with no further call.
"""

import importlib

__version__ = "0.1.0"


def _register_model_families() -> None:
    import fla  # noqa: F401  (registers FLA's configs and models)

    # FLA's softmax-attention layer (samba and other hybrids) needs flash-attn: stand-ins when absent
    from flame.models.cpu import enable_cpu_fallbacks

    enable_cpu_fallbacks()  # also installs the flash-attn stand-ins
    # flame's transformer replaces FLA's "transformer" entry (which needs flash_attn)
    for name in ("flame.models.transformer", "custom_models"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise


_register_model_families()

from flame.utils.autotune import limit_autotune_from_env  # noqa: E402

limit_autotune_from_env()
