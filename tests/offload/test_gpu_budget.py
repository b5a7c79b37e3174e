"""The GPU cap's arithmetic (planner.budgets, no torch): the cap is the whole process on the
device; the allocator's reserved bytes get the cap minus the driver memory outside it; the plan
gets that minus the fragmentation headroom. Hand arithmetic as the reference."""

import dataclasses

import pytest

from flame.errors import ConfigError
from flame.offload.planner import budgets
from flame.offload.planner.budgets import GiB, gpu_budget
from flame.offload.planner.hardware import from_dict

MiB = 2**20


def test_a_cap_is_split_into_driver_memory_allocator_and_plan():
    b = gpu_budget(16.0, 2.0, 80 * GiB, context_bytes=600 * MiB)
    outside = 600 * MiB + budgets.OUTSIDE_ALLOCATOR_GROWTH_BYTES
    assert b.cap_bytes == 16 * GiB
    assert b.outside_allocator_bytes == outside
    assert b.allocator_bytes == 16 * GiB - outside
    assert b.plan_bytes == int((16 * GiB - outside) * (1 - budgets.FRAGMENTATION_HEADROOM))
    # every byte of the cap is accounted for, and the plan never reaches the allocator's cap
    assert b.outside_allocator_bytes + b.allocator_bytes == b.cap_bytes
    assert b.plan_bytes < b.allocator_bytes


def test_a_cap_above_the_device_is_the_device():
    b = gpu_budget(100.0, 2.0, 80 * GiB, context_bytes=GiB)
    assert b.allocator_bytes == 80 * GiB - GiB - budgets.OUTSIDE_ALLOCATOR_GROWTH_BYTES


def test_no_cap_is_the_device_minus_the_driver_memory_and_the_margin_and_caps_nothing():
    """The driver memory measured outside the allocator (the CUDA context, NCCL's communicator) is
    not the plan's: a plan that took it filled the GPU and NCCL ran out of memory."""
    b = gpu_budget(0.0, 2.0, 80 * GiB, context_bytes=GiB)
    assert (b.plan_bytes, b.allocator_bytes, b.outside_allocator_bytes) == (77 * GiB, 0, GiB)
    assert gpu_budget(0.0, 2.0, 80 * GiB, context_bytes=None).plan_bytes == 78 * GiB


def test_without_a_gpu_the_plan_is_the_whole_cap():
    b = gpu_budget(3.0, 2.0, 80 * GiB, context_bytes=None)
    assert (b.plan_bytes, b.allocator_bytes, b.outside_allocator_bytes) == (3 * GiB, 0, 0)


def test_a_cap_the_driver_alone_exceeds_is_one_error_naming_it():
    with pytest.raises(ConfigError, match=r"offload.gpu_memory_gib=0.5: must be more than"):
        gpu_budget(0.5, 2.0, 80 * GiB, context_bytes=600 * MiB)


def test_the_calculator_counts_the_profiles_measured_context_else_the_default():
    from flame.offload import gpu_plan_bytes
    from flame.offload.config import Offload
    from tests.offload.test_planner import prof

    off = Offload(gpu_memory_gib=8.0)
    measured = prof(cuda_context_bytes=700 * MiB)
    assert gpu_plan_bytes(off, "cpu", measured, True) == gpu_budget(8.0, 2.0, 80 * GiB, 700 * MiB).plan_bytes
    assert gpu_plan_bytes(off, "cpu", prof(), True) == gpu_budget(
        8.0, 2.0, 80 * GiB, budgets.DEFAULT_CUDA_CONTEXT_BYTES).plan_bytes
    # a CPU run of the engine plans the whole cap
    assert gpu_plan_bytes(off, "cpu", measured, False) == 8 * GiB


def test_profiles_stored_before_the_context_was_measured_still_load():
    from tests.offload.test_planner import prof

    old = dataclasses.asdict(prof())
    del old["cuda_context_bytes"]
    assert from_dict(old).cuda_context_bytes == 0


def test_profile_measurement_buffers_fit_the_allocator_cap():
    """The hardware profile measured under a GPU cap sizes its buffers from the allocator's cap:
    two copy buffers of an eighth each, matmul operands and result within half."""
    from flame.offload.measure.hardware import fitting_gemm, transfer_bytes

    MiB = 1 << 20
    assert transfer_bytes(80 * GiB) == GiB
    assert transfer_bytes(2 * GiB) == 256 * MiB
    assert transfer_bytes(int(2.03 * GiB)) % MiB == 0 and 2 * transfer_bytes(int(2.03 * GiB)) <= int(2.03 * GiB) // 4
    assert transfer_bytes(10 * MiB) == 16 * MiB
    room = 4 * GiB
    m, n, k = fitting_gemm(8192, 128256, 4096, room)
    assert (n, k) == (128256, 4096) and 2 * (m * k + k * n + m * n) <= room // 2 and m >= 256
    room = 2 * GiB  # the head's weight alone is over half: fewer columns too
    m, n, k = fitting_gemm(8192, 128256, 4096, room)
    assert m == 256 and k == 4096 and 2 * (m * k + k * n + m * n) <= room // 2
    assert fitting_gemm(2048, 1024, 1024, room) == (2048, 1024, 1024)  # fits: unchanged
