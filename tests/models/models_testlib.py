"""Helpers shared by tests/models (a uniquely named module: several test folders have conftests)."""
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

warnings.filterwarnings('ignore', message='.*Triton is not supported.*')

DEBUG_DIR = os.path.join(ROOT, 'configs', 'debug')
FLA_FAMILIES = ('gla', 'delta_net', 'gated_deltanet', 'gsa', 'hgrn2', 'mamba', 'mamba2', 'samba')


def debug_config(name):
    import fla  # noqa: F401
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(os.path.join(DEBUG_DIR, f'{name}.json'))
