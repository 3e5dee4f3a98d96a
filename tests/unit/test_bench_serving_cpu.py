"""`raylane bench serving-cpu`'s accounting: each process's CPU time lands under its own name, the
names that Ray's and raylane's processes have on a served cluster."""

import subprocess
import sys
import time

from raylane.bench.common import process_name, process_tree_cpu_by_name

# Spends 0.3 s of CPU time, then idles, so that it is still there to be read.
SPIN = [
    "import time",
    "t = time.process_time()",
    "while time.process_time() - t < 0.3: pass",
    "time.sleep(60)",
]


def test_a_childs_cpu_time_is_counted_under_its_name_not_this_process():
    before = process_tree_cpu_by_name()
    child = subprocess.Popen([sys.executable, "-m", "timeit", "-n", "1", "-r", "1", *SPIN])
    try:
        for _ in range(600):  # until the child has spun (it polls its own CPU clock)
            if process_tree_cpu_by_name().get("timeit", 0.0) >= 0.3:
                break
            time.sleep(0.05)
        after = process_tree_cpu_by_name()
    finally:
        child.kill()
        child.wait()
    assert after["timeit"] >= 0.3
    assert after["this process"] - before["this process"] < 0.3  # the polling, not the child's spin


def test_served_processes_are_named_by_their_role():
    assert (
        process_name(["ray::ServeReplica:raylane:Gateway.handle_request", ""])
        == "ServeReplica:raylane:Gateway"
    )
    assert process_name(["ray::ServeController.listen_for_change"]) == "ServeController"
    assert (
        process_name(["/venv/bin/python", "-m", "raylane.engine.core_proc", "57"])
        == "raylane.engine.core_proc"
    )
    assert (
        process_name(["/venv/bin/python", "-u", "/venv/ray/_private/log_monitor.py", "--x"])
        == "log_monitor.py"
    )
    assert process_name(["/venv/ray/core/src/ray/gcs/gcs_server", "--log_dir=/tmp"]) == "gcs_server"
    assert process_name(["/cache/bin/llama-server", "-m", "/m/model.gguf", "-t", "1"]) == "llama-server"
    assert process_name(["/venv/bin/python", "/tmp/llama-server", "-m", "x.gguf"]) == "llama-server"
    assert process_name(["/venv/bin/python", "-B", "-c", "from multiprocessing import x"]) == "python"
