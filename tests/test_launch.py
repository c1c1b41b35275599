"""labsupport.launch on real processes: results, environment, failures, hygiene."""

from __future__ import annotations

import contextlib
import json
import multiprocessing.forkserver
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from labsupport import LaunchError, LaunchTimeout, launch, warm_up
from labsupport.launch import errors, launcher, loopback, nodes, runtime
from labsupport.models import random_tokens, tiny_gpt

TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def rank_descendants() -> list[psutil.Process]:
    """Processes below our children: ranks (children of the forkserver) and theirs."""
    me = os.getpid()
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.ppid() != me and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
    return found


def assert_no_ranks_left(pids=()) -> None:
    deadline = time.monotonic() + 5
    while rank_descendants() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rank_descendants() == []
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def env_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {k: os.environ[k] for k in TORCHRUN_VARS} | {"sum": t.item(), "pid": os.getpid()}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_in_rank_order_with_the_torchrun_environment(world_size):
    results = launch(env_and_sum, world_size=world_size, timeout=60)
    assert [r["RANK"] for r in results] == [str(i) for i in range(world_size)]
    assert [r["LOCAL_RANK"] for r in results] == [str(i) for i in range(world_size)]
    for r in results:
        assert r["WORLD_SIZE"] == r["LOCAL_WORLD_SIZE"] == str(world_size)
        assert r["GROUP_RANK"] == "0"
        assert r["MASTER_ADDR"] == "127.0.0.1" and int(r["MASTER_PORT"]) > 0
        assert r["sum"] == world_size * (world_size + 1) / 2
    assert len({r["pid"] for r in results}) == world_size
    assert_no_ranks_left([r["pid"] for r in results])


def test_lambdas_closures_and_arguments_travel_by_value():
    offset = 10  # captured by the closure below

    def closure(scale, *, shift):
        return dist.get_rank() * scale + shift + offset

    assert launch(closure, 3, args=(2,), kwargs={"shift": 1}, timeout=60) == [11, 13, 15]
    assert launch(lambda: dist.get_world_size() * 7, 2, timeout=60) == [14, 14]


def test_device_is_cpu_with_gloo_and_threads_are_shared_out(monkeypatch):
    monkeypatch.delenv("LABSUPPORT_THREADS", raising=False)  # set by the portable runs
    results = launch(lambda: (str(runtime.device()), torch.get_num_threads()), 2, timeout=60)
    cores = len(os.sched_getaffinity(0))
    assert results == [("cpu", max(1, cores // 2))] * 2


def test_unpicklable_argument_fails_before_any_rank_starts():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(LaunchError, match="pickle") as info:
        launch(lambda lock: None, 2, args=(threading.Lock(),), timeout=60)
    assert "inside fn" in str(info.value)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def raise_on_rank_one():
    t = torch.ones(4)
    if dist.get_rank() == 1:
        time.sleep(0.2)  # the others are already blocked in all_reduce
        raise ValueError("rank one is broken")
    dist.all_reduce(t)
    return os.getpid()


def test_one_rank_raising_stops_the_others_blocked_in_all_reduce():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(raise_on_rank_one, 4, timeout=120)
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"failure took {elapsed:.1f} s to surface"
    error = info.value
    assert error.root_rank == 1
    text = str(error)
    assert text.startswith("rank 1 failed (root cause): ValueError: rank one is broken")
    assert 'raise ValueError("rank one is broken")' in text  # the source line is quoted
    assert "test_launch.py" in text
    assert set(error.failures) == {0, 1, 2, 3}
    assert all(error.failures[r].knock_on for r in (0, 2, 3))
    assert_no_ranks_left()


def kill_myself_on_rank(rank, how):
    if dist.get_rank() == rank:
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    dist.barrier()


@pytest.mark.parametrize(
    ("how", "summary"), [("signal", "killed by signal SIGKILL"), ("exit", "exited with code 3")]
)
def test_a_rank_dying_without_a_python_error_is_reported(how, summary):
    with pytest.raises(LaunchError) as info:
        launch(kill_myself_on_rank, 3, args=(2, how), timeout=60)
    assert info.value.root_rank == 2
    assert info.value.failures[2].summary.startswith(summary)
    assert str(info.value).startswith(f"rank 2 failed (root cause): {summary}")
    assert_no_ranks_left()


def hang_with_a_child():
    if dist.get_rank() == 0:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        time.sleep(600)
    dist.barrier()


def test_a_silent_hang_hits_the_timeout_and_kills_what_the_ranks_started():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(hang_with_a_child, 3, timeout=3)
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert "timed out after 3 s" in text and "still running: 0, 1, 2" in text
    assert "time.sleep(600)" in text  # where rank 0 hung
    assert "in barrier" in text  # where the others waited
    assert_no_ranks_left()


def fail_with_a_child_in_its_own_session(marker):
    subprocess.Popen(["sleep", marker], start_new_session=True)  # as torchrun starts workers
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 fails")
    dist.barrier()


def sleepers(marker):
    return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", marker]]


def test_a_failed_launch_stops_what_its_ranks_started_in_sessions_of_their_own():
    marker = f"{600 + os.getpid() % 97}.5"  # a command line no other test runs
    with pytest.raises(LaunchError, match="rank 0 fails"):
        launch(fail_with_a_child_in_its_own_session, 3, args=(marker,), timeout=60)
    left = sleepers(marker)
    for proc in left:
        proc.kill()
    assert left == [], "children in their own sessions outlived their ranks"


def big_result(megabytes):
    return torch.full((megabytes * 2**20 // 4,), float(dist.get_rank()))


def test_large_return_values_do_not_deadlock():
    results = launch(big_result, 2, args=(100,), timeout=120)
    assert [r.numel() * 4 for r in results] == [100 * 2**20] * 2
    assert results[1][-1].item() == 1.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def what_launches_leave(launches: int) -> dict:
    """Open descriptors, child processes and files in the temporary folder after one
    launch (the forkserver is up) and after ``launches`` more and a failing one."""

    def state():
        return {
            "fds": open_fds(),
            "children": sorted(p.pid for p in psutil.Process().children()),
            "temp": sorted(os.listdir(tempfile.gettempdir())),
        }

    launch(env_and_sum, 2, timeout=60)
    before = state()
    for _ in range(launches):
        launch(env_and_sum, 2, timeout=60)
    with contextlib.suppress(LaunchError):
        launch(raise_on_rank_one, 2, timeout=60)
    assert_no_ranks_left()
    return {"before": before, "after": state()}


def test_fifty_launches_leak_no_processes_or_file_descriptors():
    """Run in a Python of its own whose temporary folder is this test's: what it finds
    there, only its launches made (multiprocessing's ``pymp-*`` folder, anything a rank
    leaves behind), whatever other programs on the machine do meanwhile. The folder sits
    directly in the test run's own temporary folder: the forkserver's socket lives in it,
    and a socket's path may not be longer than 107 bytes (pytest's ``tmp_path`` can be)."""
    code = (
        f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import test_launch\n"
        "print(json.dumps(test_launch.what_launches_leave(50)))\n"
    )
    folder = Path(tempfile.mkdtemp(prefix="fifty-"))
    try:
        env = dict(os.environ, TMPDIR=str(folder))
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        state = json.loads(out.stdout.splitlines()[-1])
        assert state["after"] == state["before"]
        assert [name for name in state["before"]["temp"] if name.startswith("pymp-")], state
        # once that Python has exited, only torch's compile cache (kept on purpose) is left
        left = [p.name for p in folder.iterdir() if not p.name.startswith("torchinductor_")]
        assert left == [], "the launcher left files in the temporary folder"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_callers_environment_is_untouched_after_success_and_failure():
    before = dict(os.environ)
    launch(env_and_sum, 2, env={"EXTRA_FOR_RANKS": "1"}, timeout=60)
    assert dict(os.environ) == before
    with pytest.raises(LaunchError):
        launch(raise_on_rank_one, 2, timeout=60)
    assert dict(os.environ) == before


def test_extra_environment_reaches_the_ranks_only():
    assert launch(lambda: os.environ.get("EXTRA_FOR_RANKS"), 2, env={"EXTRA_FOR_RANKS": "x"}) == [
        "x",
        "x",
    ]
    assert "EXTRA_FOR_RANKS" not in os.environ


def chatty():
    print(f"hello from {dist.get_rank()}")
    print(f"oops from {dist.get_rank()}", file=sys.stderr)
    return None


def test_output_is_prefixed_with_the_rank(capsys):
    launch(chatty, 2, timeout=60)
    out, err = capsys.readouterr()
    assert sorted(line for line in out.splitlines() if "hello" in line) == [
        "[rank 0] hello from 0",
        "[rank 1] hello from 1",
    ]
    assert "[rank 1] oops from 1" in err


@pytest.mark.skipif(runtime.gpus_visible() >= 2, reason="this machine has GPUs for nccl")
def test_nccl_without_gpus_is_a_clear_error_before_anything_starts():
    with pytest.raises(LaunchError, match="one GPU per rank.*backend='gloo'"):
        launch(env_and_sum, 2, backend="nccl")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be a positive integer"),
        ({"world_size": 2.5}, "world_size must be a positive integer"),
        ({"timeout": -1}, "timeout must be a positive number"),
        ({"backend": "carrier-pigeon"}, "unknown backend"),
    ],
)
def test_bad_arguments_are_refused_with_a_message(kwargs, message):
    with pytest.raises((ValueError, LaunchError), match=message):
        launch(env_and_sum, **({"world_size": 2} | kwargs))


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="needs a function"):
        launch("not a function", 2)


def interrupt_soon(pid, delay):
    threading.Timer(delay, os.kill, args=(pid, signal.SIGINT)).start()


def test_keyboard_interrupt_stops_every_rank():
    # A shell starts background jobs with SIGINT ignored, and Python then keeps it
    # ignored (this test failed so, under `.ci/run &`); Jupyter's kernel, like an
    # interactive Python, raises KeyboardInterrupt, which is what is tested here.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupt_soon(os.getpid(), 1.5)
        with pytest.raises(KeyboardInterrupt):
            launch(hang_with_a_child, 3, timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert_no_ranks_left()


def test_a_script_without_a_main_guard_is_told_what_to_do(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text("from labsupport import launch\nlaunch(lambda: 1, 2, timeout=60)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert 'call launch() under `if __name__ == "__main__":`' in out.stderr


def start_a_daemon_holding_stdout():
    daemon = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True
    )
    print("started a daemon")
    return daemon.pid


def test_a_process_that_escapes_the_rank_does_not_hold_the_launch():
    start = time.monotonic()
    pids = launch(start_a_daemon_holding_stdout, 2, timeout=60)
    try:
        assert time.monotonic() - start < 10, "launch waited for the daemon's stdout"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def busy_then_count(steps: int) -> int:
    from labsupport.launch.progress import progress, status

    if dist.get_rank() == 0:
        status("building   the\n extension")  # one line, whatever it is given
    return sum(1 for _ in progress(range(steps), "count"))


def test_a_rank_status_and_finished_bars_are_shown_in_a_terminal(capsys):
    assert launch(busy_then_count, 2, args=(3,)) == [3, 3]
    out = capsys.readouterr().out.splitlines()
    assert "[rank 0] building the extension" in out
    assert not any(line.startswith("[rank 1] building") for line in out)
    for rank in range(2):
        assert f"[rank {rank}] count |{'#' * 24}| 3/3" in out
    assert not any("\x1e" in line for line in out)


def test_outside_a_launch_a_status_is_printed_on_local_rank_0_only(monkeypatch, capsys):
    from labsupport.launch.progress import status

    monkeypatch.delenv("LABSUPPORT_LIVE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    status("building")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    status("building")
    assert capsys.readouterr().out == "building\n"


def test_warm_up_starts_the_forkserver_ahead_of_the_first_launch():
    warm_up()
    assert multiprocessing.forkserver._forkserver._forkserver_pid is not None
    assert launch(lambda: dist.get_rank(), 2, timeout=60) == [0, 1]


def test_a_notebook_function_using_dist_and_a_config_attribute_travels():
    """cloudpickle takes along the submodules a function's code names, and would fail on
    ``torch.distributed.config`` (a ModuleType subclass) for any ``x.config``."""

    def config_and_rank():
        return tiny_gpt().config.n_embd + dist.get_rank()

    assert launch(config_and_rank, 2, timeout=60) == [64, 65]


# --------------------------------------------------------------------------- launch cost


def test_the_forkserver_preloads_what_ranks_need_and_runs_no_thread():
    """What the forkserver holds after preloading, in a Python of its own that imports
    the same modules: torch._dynamo (a rank's first optimizer would import it), one
    thread (OpenBLAS's pool stopped), no CUDA context, nothing for plotting."""
    code = (
        "import os, sys, threading\n"
        f"for name in {launcher.PRELOAD!r}: __import__(name)\n"
        "import torch\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(threading.active_count(), len(os.listdir('/proc/self/task')),\n"
        "      'torch._dynamo' in sys.modules, 'torch.distributed.checkpoint' in sys.modules,\n"
        "      torch.cuda.is_initialized(), 'libcuda.so' in maps,\n"
        "      any(m in sys.modules for m in ('matplotlib', 'IPython', 'ipywidgets')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.split() == ["1", "1", "True", "True", "False", "False", "False"]


def test_the_running_forkserver_has_one_thread():
    launch(env_and_sum, 2, timeout=60)
    server = multiprocessing.forkserver._forkserver
    assert server._preload_modules == launcher.PRELOAD
    assert os.listdir(f"/proc/{server._forkserver_pid}/task") == [str(server._forkserver_pid)]


def first_training_steps() -> list[str]:
    """A rank's first optimizer, forward, backward, all-reduce and step, on a Linear and
    on the course's GPT; returns the modules they imported."""
    before = set(sys.modules)
    model = torch.nn.Linear(8, 8)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).square().mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    adam.step()
    gpt = tiny_gpt()
    adamw = torch.optim.AdamW(gpt.parameters(), lr=1e-3, weight_decay=0.1)
    gpt(*random_tokens(2, 16, 256))[1].backward()
    adamw.step()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return sorted(set(sys.modules) - before)


def test_a_ranks_first_optimizer_step_imports_nothing_heavy():
    """Before the forkserver preloaded torch._dynamo, every rank of every launch imported
    some 800 modules (2.5-3.5 s) at its first optimizer."""
    for imported in launch(first_training_steps, 2, timeout=120):
        heavy = [m for m in imported if m.startswith(("torch._dynamo", "torch._inductor", "sympy"))]
        assert heavy == [] and len(imported) <= 3, imported


# --------------------------------------------------------------------------- loopback only


def hold_the_group(seconds: float = 1.0):
    time.sleep(seconds)  # the store and the ranks' sockets are up meanwhile
    return int(os.environ["MASTER_PORT"]), os.environ.get("GLOO_SOCKET_IFNAME")


def test_everything_a_launch_listens_on_is_on_the_loopback_interface():
    with loopback.watch_listening() as seen:
        results = launch(hold_the_group, 3, timeout=60)
    port = results[0][0]
    assert (os.getpid(), "127.0.0.1", port) in seen, "the store was not seen on 127.0.0.1"
    assert len(seen) > 1, "nor the ranks' sockets"
    assert loopback.exposed(seen) == set()
    assert {interface for _, interface in results} == {loopback.interface()}


def listening_ports() -> set[int]:
    return {port for _, _, port in loopback.listening(os.getpid())}


def test_a_loopback_store_server_is_shared_by_torchs_own_store_and_closes_its_socket():
    fds = open_fds()
    server = loopback.store_server()
    port = server.port
    assert (os.getpid(), "127.0.0.1", port) in loopback.listening(os.getpid())
    # what torch's env:// or tcp:// rendezvous creates next, in the same process
    same = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True)
    client = dist.TCPStore("127.0.0.1", port, is_master=False)
    client.set("key", "value")
    assert server.get("key") == same.get("key") == b"value"
    assert not loopback.exposed(loopback.listening(os.getpid()))
    del server, same, client
    assert port not in listening_ports() and open_fds() == fds


def test_only_the_rank_that_hosts_a_loopback_store_opens_one(monkeypatch):
    assert loopback.is_loopback("localhost") and loopback.is_loopback("::1")
    assert not loopback.is_loopback("192.0.2.1") and not loopback.is_loopback("no.such.host.")
    assert loopback.host_store("192.0.2.1", 29500) is None  # another machine's store
    assert loopback.host_store("::1", 29500) is None  # its clients would not find 127.0.0.1
    port = nodes.free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "1")
    assert loopback.host_env_store() is None  # rank 0 hosts it
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert loopback.host_env_store() is None  # the agent hosts it
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    store = loopback.host_env_store()
    assert store.port == port and port in listening_ports()
    assert loopback.host_env_store() is None  # taken: torch shares the one it has


# --------------------------------------------------------------------------- without ranks


def test_auto_backend_pairs_gloo_with_nccl_only_with_a_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(runtime, "gpus_visible", lambda: 2)
    assert runtime.resolve_backend("auto", 2) == "cpu:gloo,cuda:nccl"
    assert runtime.resolve_backend("auto", 3) == "gloo"
    assert runtime.resolve_backend("gloo", 1) == "gloo"
    with pytest.raises(ValueError, match="3 ranks on this node but 2 GPU"):
        runtime.resolve_backend("nccl", 3)


def test_errors_are_summarised_without_cxx_locations():
    long = (
        "RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
        "Connection closed by peer [127.0.0.1]:4242. This is typically caused by a crash."
    )
    assert errors.shorten(long) == "RuntimeError: Connection closed by peer [127.0.0.1]:4242."
    failure = errors.RankFailure(0, "exception", long)
    assert failure.knock_on
    assert not errors.RankFailure(1, "exception", "ValueError: bad shard").knock_on
    assert not errors.RankFailure(1, "signal", "killed by signal SIGKILL").knock_on
