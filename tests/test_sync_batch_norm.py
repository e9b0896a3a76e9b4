"""SyncBatchNorm: on 2 and 4 ranks it matches torch.nn.BatchNorm over the concatenated batch."""

import pathlib

import pytest
from mpijob import mpirun

JOB = (pathlib.Path(__file__).parent / "jobs" / "sync_batch_norm.py").read_text()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np", [2, 4])
def test_sync_batch_norm_matches_batch_norm_on_the_whole_batch(np):
    result = mpirun(np, JOB, timeout=80)
    failures = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert not failures, "\n".join(failures[:40])
    done = [line for line in result.stdout.splitlines() if line.startswith("DONE")]
    assert len(done) == np and all(line.endswith(" 0 failures") for line in done), result.output[-4000:]
    assert result.returncode == 0, result.output[-4000:]


@pytest.mark.timeout(60)
def test_one_rank_is_plain_batch_norm_and_bad_inputs_are_named():
    result = mpirun(1, """
        import torch
        import ringmaster as rm

        def error(module, x):
            try:
                module(x)
            except ValueError as e:
                return str(e)
            return "no error"

        synced = rm.SyncBatchNorm(4)
        print("1-D:", error(synced, torch.randn(4)))
        print("6-D:", error(synced, torch.randn(2, 4, 1, 1, 1, 1)))
        print("channels:", error(synced, torch.randn(2, 3)))
        try:
            synced(torch.randn(2, 4))
        except rm.NotInitializedError:
            print("training before init: NotInitializedError")

        rm.init()
        for options in ({}, {"momentum": None}, {"affine": False}, {"track_running_stats": False}):
            torch.manual_seed(0)
            synced, plain = rm.SyncBatchNorm(4, **options), torch.nn.BatchNorm2d(4, **options)
            differences = []
            for step in range(3):
                x = torch.randn(5, 4, 3, 3) * 2 + 1
                a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
                weights = torch.randn(5, 4, 3, 3)
                (synced(a) * weights).sum().backward()
                (plain(b) * weights).sum().backward()
                pairs = [(a.grad, b.grad)]
                pairs += [(p.grad, q.grad) for p, q in zip(synced.parameters(), plain.parameters())]
                pairs += list(zip(synced.buffers(), plain.buffers()))
                differences += [(p.double() - q.double()).abs().max().item() for p, q in pairs]
            synced.eval(), plain.eval()
            x = torch.randn(2, 4, 3, 3)
            differences.append((synced(x) - plain(x)).abs().max().item())
            print("size 1", options, "max difference", max(differences))
        rm.shutdown()
    """, timeout=50)
    assert result.returncode == 0, result.output[-4000:]
    lines = result.stdout.splitlines()
    assert "1-D: SyncBatchNorm expects a 2-D to 5-D input shaped (N, C, ...), got a 1-D input" in result.stdout
    assert any(line.startswith("6-D: SyncBatchNorm expects a 2-D to 5-D input") for line in lines)
    assert any(line.startswith("channels: SyncBatchNorm(4) got an input with 3 channels") for line in lines)
    assert "training before init: NotInitializedError" in lines
    sizes = [line for line in lines if line.startswith("size 1")]
    assert len(sizes) == 4 and all(line.endswith("max difference 0.0") for line in sizes), result.stdout
