"""Hugging Face Hub upload of the final export: background thread, bounded wait, never fatal."""

import logging
import os
import threading

import huggingface_hub
import pytest

from flame.components.export import HFUpload
from tests.trainer.helpers import run_job


def test_unreachable_hub_logs_one_warning_and_training_succeeds(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    dump = str(tmp_path / "run")
    proc = run_job(1, dump, "--training.steps", "2", "--checkpoint.no-enable", "--checkpoint.export-hf",
                   "--checkpoint.hf_upload_enabled", "--checkpoint.hf_repo_base_name", "flame-test/tiny")
    assert os.path.isfile(os.path.join(dump, "hf", "config.json"))
    out = proc.stdout + proc.stderr
    failed = [l for l in out.splitlines() if "flame: HF upload of" in l]
    assert len(failed) == 1, out[-3000:]
    assert f"HF upload of {dump}/hf to flame-test/tiny failed:" in failed[0] and failed[0].endswith("(no network?)")
    assert "Traceback" not in out


class _FakeApi:
    calls: list = []
    release = threading.Event()

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))

    def upload_folder(self, **kw):
        self.calls.append(("upload_folder", kw))
        assert self.release.wait(10)
        return type("CommitInfo", (), {"commit_url": "https://hub.example/commit/1"})()


def test_upload_runs_in_the_background_and_logs_success(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeApi)
    _FakeApi.calls.clear()
    _FakeApi.release.clear()
    caplog.set_level(logging.INFO)
    up = HFUpload(str(tmp_path), "org/model", step=7)
    assert up.wait(timeout=0.2) is False  # still uploading: the caller is not blocked
    assert "still running" in caplog.text
    _FakeApi.release.set()
    assert up.wait(timeout=10) is True and up.done and up.error is None
    assert _FakeApi.calls[0][:2] == ("create_repo", "org/model") and _FakeApi.calls[0][2]["exist_ok"]
    kw = _FakeApi.calls[1][1]
    assert (kw["folder_path"], kw["repo_id"]) == (str(tmp_path), "org/model") and "step 7" in kw["commit_message"]
    assert "uploaded" in caplog.text and "https://hub.example/commit/1" in caplog.text


def test_upload_failure_is_a_warning_not_an_exception(tmp_path, monkeypatch, caplog):
    class Broken:
        def create_repo(self, *a, **kw):
            raise PermissionError("403 Forbidden: you are not a member of org")

    monkeypatch.setattr(huggingface_hub, "HfApi", Broken)
    up = HFUpload(str(tmp_path), "org/model", step=1)
    assert up.wait(timeout=10) and not up.done
    assert up.error == "PermissionError: 403 Forbidden: you are not a member of org"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "HF upload" in r.getMessage()]
    assert len(warnings) == 1 and f"HF upload of {tmp_path} to org/model failed: PermissionError" in warnings[0].getMessage()
