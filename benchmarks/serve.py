"""The server under load: throughput and latency per stream count, its live dashboard, the diagnosis of
planted slowdowns and bugs, prefix caching, memory pressure, long contexts, grammars, tools and penalties, and N
streams through the batch engine in process (batch-streams), and where a server's passes went (pass-log).

    python benchmarks/serve.py SUBCOMMAND [ARGS]     # python benchmarks/serve.py lists them; SUBCOMMAND -h shows one's options
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "suite"))
from entry import dispatch  # noqa: E402

COMMANDS = {
    "load": "load.py", "diagnosis": "diagnosis.py", "planted-bugs": "planted_bugs.py", "prefix-ttft": "prefix_ttft.py",
    "memory-waves": "memory_waves.py", "long-context": "long_context.py", "structured": "structured.py",
    "tool-calls": "tool_calls.py", "penalties": "penalties.py", "batch-streams": "batch_streams.py",
    "pass-log": "pass_log.py",
}

if __name__ == "__main__":
    sys.exit(dispatch(__doc__, COMMANDS))
