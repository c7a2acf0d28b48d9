"""Tokenizing workers forked from a process that holds garbage whose destructor is unsafe in a child.

An earlier in-process run can leave a gloo process group as garbage in a reference cycle; its
destructor waits for gloo's worker threads, which a forked child does not have. The suite hung
there (a ``data.num_proc`` worker blocked forever inside a tokenizer call) until the parent
collected and froze its garbage before forking (:func:`automodel.data.workers.forked_workers`).
"""

import subprocess
import sys
import textwrap

import pytest

# After the imports (they allocate enough to trigger a full collection in the parent).
_LEAK = """
import gc, os
import torch.distributed as dist
store = dist.HashStore()
held = [dist.ProcessGroupGloo(store, 0, 1)]
held.append(held)  # a cycle: freed only by the garbage collector
gc.collect()  # the cycle moves to the oldest generation
del held  # garbage now, until the next full collection
os.register_at_fork(after_in_child=gc.collect)  # a child that collects at once
"""

_SFT = """
import datasets
from automodel.data.sft import load_tokenizer, tokenize_sft_dataset
{leak}
rows = datasets.Dataset.from_list([{{"prompt": f"q {{i}}", "completion": f"a {{i}}"}} for i in range(64)])
print("rows", len(tokenize_sft_dataset(rows, load_tokenizer("tiny"), format="prompt_completion", num_proc=2)))
"""

_TOKEN_FILE = """
import pathlib, sys
from automodel.data.sft import load_tokenizer
from automodel.data.token_files import write_token_file
{leak}
work = pathlib.Path(sys.argv[1])
(work / "a.txt").write_text("".join(f"line {{i}}\\n" for i in range(200)))
out = write_token_file(str(work / "a.txt"), work / "out.tokens", load_tokenizer("tiny"), batch_bytes=64, num_proc=2)
print("rows", out.meta["documents"])
"""


@pytest.mark.parametrize("script, rows", [(_SFT, 64), (_TOKEN_FILE, 200)], ids=["datasets_map", "token_file"])
def test_workers_never_run_a_destructor_they_inherited(tmp_path, script, rows):
    code = textwrap.dedent(script).format(leak=textwrap.dedent(_LEAK))
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"rows {rows}" in done.stdout
