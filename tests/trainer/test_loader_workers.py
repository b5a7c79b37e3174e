"""Data-loader workers of a run whose trained state lives in host memory (CPU runs, the offload
engine) start from a fork server. A worker forked from the trainer keeps the pages it shared at
the fork; as the optimizer rewrites the host state every step, copy-on-write then holds that
memory twice (a 3B model's offloaded state grew by about 28 GB that way and was killed)."""

import functools
import os

from tests.trainer.helpers import losses, tiny_job, train_in_process


def _record_parent(folder: str, worker_id: int) -> None:
    with open(os.path.join(folder, f"worker{worker_id}.ppid"), "w") as f:
        f.write(str(os.getppid()))


def test_workers_are_not_forked_from_a_trainer_whose_state_is_in_host_memory(tmp_path):
    def before_train(trainer):
        assert trainer.parts.state_in_host_memory  # a CPU run
        trainer.dataloader.worker_init_fn = functools.partial(_record_parent, str(tmp_path))

    dump = str(tmp_path / "dump")
    train_in_process(tiny_job(dump, "--training.steps", "3", "--training.num_workers", "2"), before_train)
    parents = {int(open(tmp_path / f"worker{i}.ppid").read()) for i in range(2)}
    assert os.getpid() not in parents, "workers were forked from the trainer"
    assert len(losses(dump)) == 3
