"""`forked_plugins`: vLLM's plugins-loaded flag cleared in each process forked after `arm()`, so
vLLM loads its general plugins again in an engine core or worker it forks (as it does under
`spawn`); the parent's flag stays; a vLLM without the flag is left alone. Over a stand-in
`vllm.plugins` module in a child interpreter (the real path: tests/test_vllm_engine_failure.py,
`vllm` start method). Mutation seen to fail it: `arm()` registering no fork hook."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, os, sys, types
from runner_fsm.integrations.vllm import forked_plugins

plugins = types.ModuleType("vllm.plugins")
sys.modules["vllm.plugins"] = plugins
seen = {"without the flag": forked_plugins.arm()}
plugins.plugins_loaded = True
seen["armed"] = forked_plugins.arm()
seen["armed again"] = forked_plugins.arm()


def in_child(body):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write_end, json.dumps(body()).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    return json.loads(os.read(read_end, 4096))


def child():
    flag = plugins.plugins_loaded
    plugins.plugins_loaded = True  # the child loads them: its own children must load them again
    return [flag, in_child(lambda: plugins.plugins_loaded)]


seen["child, grandchild"] = in_child(child)
seen["parent"] = plugins.plugins_loaded
print(json.dumps(seen))
"""


def test_a_forked_process_loads_vllms_plugins_again_and_the_parent_keeps_them():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"without the flag": False, "armed": True, "armed again": True,
                                       "child, grandchild": [False, False], "parent": True}
