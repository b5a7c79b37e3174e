"""Entry point the trainer calls on CPU: ``flame.models.fla_cpu.enable_cpu_fallbacks()``.

The implementation lives in :mod:`flame.models.cpu`; see its docstring for what is covered.
"""
from flame.models.cpu import CPU_FAMILIES, cpu_fallbacks_enabled, enable_cpu_fallbacks

__all__ = ['CPU_FAMILIES', 'cpu_fallbacks_enabled', 'enable_cpu_fallbacks']
