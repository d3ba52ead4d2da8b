"""Client ceiling and server utilisation: `eagle-datagen run` against the fake SGLang server.

The fake runs in its own process pinned to one core; each client runs in another process pinned to
the other core, so client and server never share an event loop or a CPU. Clients run one after the
other against the same fake, in one invocation, so their figures can be compared side by side.

Modes:

``instant``   the fake answers every request at once with ``--output-len`` ids: the client's ceiling
              (responses/s, output tokens/s, client CPU seconds per 1,000 responses).
``capacity``  the fake serves at most ``--capacity`` (B) requests at once, each holding its slot for
              ``--time-per-token-s`` × output ids; the others wait in its FIFO queue: server utilisation.

Clients (``--clients``):

``ours``             ``eagle-datagen run`` as app.py wires it (``app.run_command``, in-process in the child).
``ours-batched``     the same as ``ours`` since app.py renders 64 rows per ``apply_chat_template`` call
                     (the name is kept so earlier figures in docs/performance.md can be re-run).
``ours-prerendered`` the same, with every prompt rendered before the clock starts (render cost split out).
``ours-c=B``         ``ours`` with ``--concurrency B`` (no headroom over the server's max_running_requests).
``threadpool``       SpecForge's regenerate_train_data.py pattern: a ThreadPoolExecutor with one thread per
                     request in flight, a new HTTP client per call, ``POST /v1/chat/completions``, and a
                     main thread polling futures to write ``json.dumps`` lines.
``threadpool-shared`` the same with one shared ``httpx.Client`` (the pattern done well).

The measured window runs from the first request sent to the last response received; client CPU is
the client process's CPU time (all its threads) over that window.

Examples::

    .venv/bin/python scripts/bench_client.py instant --requests 20000 --output-len 1000 --repeat 3
    .venv/bin/python scripts/bench_client.py capacity --capacity 64 --time-per-token-s 0.0005 \\
        --output-len 1000 --requests 3000 --repeat 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
OURS = ("ours", "ours-batched", "ours-prerendered", "ours-synthetic", "ours-c=B")


# --------------------------------------------------------------------------------------------------
# Shared helpers (bench_memory.py and bench_resume.py import these)
# --------------------------------------------------------------------------------------------------


def machine() -> str:
    """One line naming the machine the figures come from."""
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{os.cpu_count()} × {model}, {mem_gib:.0f} GiB, Linux {platform.release()}, "
        f"Python {platform.python_version()} (shared machine)"
    )


def prompt_row(i: int, distinct: int | None = None) -> dict[str, Any]:
    """Row ``i`` of a synthetic prompts file: the four shapes of tests/conftest.py ``varied_rows``.

    With ``distinct``, the conversation text cycles through that many variants while every row keeps a
    unique id (so the fake answers repeats from its output cache and stays off the critical path).
    """
    if distinct is not None:
        row = prompt_row(i % (4 * max(1, distinct // 4)))  # same shape as row i
        row["id"] = f"r{i}"
        return row
    kind = i % 4
    if kind == 0:
        return {"id": f"p{i}", "prompt": f"question number {i}: what is {i} plus {i}?"}
    if kind == 1:
        return {
            "id": i,
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": f"tell me about {i}"},
                {"role": "assistant", "content": "old reply to drop"},
            ],
        }
    if kind == 2:
        return {
            "conversations": [
                {"from": "human", "value": f"first turn {i}"},
                {"from": "gpt", "value": f"answer {i}"},
                {"from": "human", "value": f"second turn {i}"},
            ]
        }
    return {
        "id": f"t{i}",
        "messages": [{"role": "user", "content": [{"type": "text", "text": f"parts {i}"}]}],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
    }


def write_prompts(path: Path, n: int, *, distinct: int | None = None, chunk: int = 100_000) -> Path:
    """A prompts file of ``n`` rows, written in chunks (flat memory for millions of rows)."""
    with path.open("wb") as handle:
        for start in range(0, n, chunk):
            rows = (prompt_row(i, distinct) for i in range(start, min(n, start + chunk)))
            handle.write(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return path


def tiny_tokenizer(work: Path) -> Path:
    from eagle_datagen.testing.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(work / "tokenizer", template="kimi")


def tokenizer_ids(path: Path) -> tuple[int, int]:
    """(vocab size, eos id) of a tokenizer directory, read without loading transformers."""
    data = orjson.loads((path / "tokenizer.json").read_bytes())
    vocab = dict(data["model"]["vocab"])
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    config = orjson.loads((path / "tokenizer_config.json").read_bytes())
    eos = config["eos_token"]
    eos = eos["content"] if isinstance(eos, dict) else eos
    return max(vocab.values()) + 1, vocab[eos]


def pin(core: int | None) -> None:
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


def cpu_cores() -> tuple[int | None, int | None]:
    """(client core, server core): two distinct cores when there are two."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= 2:
        return cores[0], cores[1]
    return None, None


class FakeServer:
    """The fake SGLang server in a subprocess pinned to ``core``."""

    def __init__(self, config: dict[str, Any], work: Path, core: int | None) -> None:
        self.config = config
        self.port_file = work / f"fake-port-{os.getpid()}-{time.monotonic_ns()}"
        self.log = (work / "fake.log").open("ab")
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        self.process = subprocess.Popen(
            [PY, "-m", "eagle_datagen.testing.fake_sglang", "--port", "0", "--port-file", str(self.port_file),
             "--config-json", json.dumps(config)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        if core is not None:
            os.sched_setaffinity(self.process.pid, {core})
        deadline = time.monotonic() + 30
        while not self.port_file.is_file() or not self.port_file.read_text().strip():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fake server did not start; see {work / 'fake.log'}")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{int(self.port_file.read_text())}"

    def get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            value: dict[str, Any] = orjson.loads(response.read())
            return value

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=orjson.dumps(body), method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            value: dict[str, Any] = orjson.loads(response.read())
            return value

    def stats(self) -> dict[str, Any]:
        return self.get("/fake/stats")

    def cpu_s(self) -> float:
        """CPU seconds the fake has used so far (utime + stime from /proc)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def reset(self) -> None:
        self.post("/fake/reset_stats", {})

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_child(spec: dict[str, Any], timeout_s: float = 600) -> dict[str, Any]:
    """Runs ``python scripts/bench_client.py _child SPEC`` and returns the JSON it prints last."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [PY, str(Path(__file__).resolve()), "_child", json.dumps(spec)],
        capture_output=True, env=env, timeout=timeout_s, check=False,
    )  # fmt: skip
    lines = [line for line in proc.stdout.decode().splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"client {spec.get('client')} failed ({proc.returncode}):\n{proc.stderr.decode()[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def rss_mb_of_children() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


# --------------------------------------------------------------------------------------------------
# Utilisation from the fake's timeline
# --------------------------------------------------------------------------------------------------


def busy_integral(timeline: list[tuple[float, int]], a: float, b: float) -> float:
    """∫ busy slots dt over [a, b], from the fake's (t, busy) change points."""
    total = 0.0
    busy_before = 0
    t_prev = a
    for t, busy in timeline:
        if t <= a:
            busy_before = busy
            continue
        if t >= b:
            break
        total += busy_before * (t - t_prev)
        t_prev, busy_before = t, busy
    return total + busy_before * max(0.0, b - t_prev)


def utilisation(stats: dict[str, Any], capacity: int, requests: int) -> dict[str, Any]:
    """Busy slots / B, integrated over the fake's (t, busy) change points.

    ``whole_run``: from the first request received to the last response sent.
    ``while_work_remains``: from the first request received to the moment fewer than B requests are
    unfinished (the (N − B + 1)-th slot release): until then a perfect client keeps every slot busy.
    ``last_10pct``: the last tenth of that window (the tail of the run, where clients that stop
    refilling early or drain a batch at a time show up).
    """
    timeline = [(float(t), int(b)) for t, b in stats["timeline"]]
    if stats.get("timeline_truncated"):
        raise RuntimeError("the fake's timeline was truncated; use fewer requests")
    start = float(stats["first_request_t"])
    end_all = float(stats["last_response_t"])
    releases = 0
    end_work = end_all
    previous = 0
    for t, busy in timeline:
        if busy < previous:
            releases += 1
            if releases == requests - capacity + 1:
                end_work = t
                break
        previous = busy

    def share(a: float, b: float) -> float | None:
        return busy_integral(timeline, a, b) / (capacity * (b - a)) if b > a else None

    tail_start = end_work - 0.1 * (end_work - start)
    return {
        "whole_run": share(start, end_all),
        "while_work_remains": share(start, end_work),
        "last_10pct": share(tail_start, end_work),
        "work_window_s": end_work - start,
        "run_s": end_all - start,
        "max_waiting": stats.get("max_waiting"),
        "max_in_flight": stats.get("max_in_flight"),
    }


# --------------------------------------------------------------------------------------------------
# The children: one client each, pinned to one core
# --------------------------------------------------------------------------------------------------


class Window:
    """First send → last response, in wall time and in this process's CPU time."""

    def __init__(self) -> None:
        self.sent = 0
        self.done = 0
        self.t0 = self.cpu0 = self.t1 = self.cpu1 = 0.0
        self.lock = threading.Lock()

    def on_send(self) -> None:
        with self.lock:
            if self.sent == 0:
                self.t0, self.cpu0 = time.monotonic(), time.process_time()
            self.sent += 1

    def on_response(self) -> None:
        with self.lock:
            self.done += 1
            self.t1, self.cpu1 = time.monotonic(), time.process_time()

    def result(self, output_tokens: int) -> dict[str, Any]:
        wall, cpu = self.t1 - self.t0, self.cpu1 - self.cpu0
        return {
            "responses": self.done,
            "wall_s": wall,
            "cpu_s": cpu,
            "responses_per_s": self.done / wall if wall > 0 else None,
            "output_tokens_per_s": output_tokens / wall if wall > 0 else None,
            "cpu_s_per_1000": 1000 * cpu / self.done if self.done else None,
            "cpu_share": cpu / wall if wall > 0 else None,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "first_send_monotonic": self.t0,
        }


def child_ours(spec: dict[str, Any]) -> dict[str, Any]:
    from eagle_datagen import app
    from eagle_datagen.generate import transport
    from eagle_datagen.inputs import render

    if spec.get("transport") == "legacy":  # the hand-written parser h11 replaced, for the side-by-side figure
        sys.path.insert(0, str(ROOT / "scripts"))
        import legacy_transport

        transport.Transport = app.Transport = legacy_transport.Transport  # type: ignore[misc, assignment]
    window = Window()
    original_post = transport.Transport.post

    async def post(self: Any, base_url: str, path: str, body: bytes, timeout_s: float) -> Any:
        window.on_send()
        try:
            return await original_post(self, base_url, path, body, timeout_s)
        finally:
            window.on_response()

    transport.Transport.post = post  # type: ignore[method-assign]
    render_cpu = {"s": 0.0, "rows": 0}
    original_render = render.Renderer.render
    original_many = getattr(render.Renderer, "render_many", None)

    def timed_render(self: Any, row: Any, path: str = "<prompts>") -> list[int]:
        t = time.thread_time()
        try:
            return original_render(self, row, path)
        finally:
            render_cpu["s"] += time.thread_time() - t
            render_cpu["rows"] += 1

    def timed_many(self: Any, rows: Any, path: str = "<prompts>") -> Any:
        assert original_many is not None
        t = time.thread_time()
        try:
            return original_many(self, rows, path)
        finally:
            render_cpu["s"] += time.thread_time() - t
            render_cpu["rows"] += len(rows)

    renderers: list[Any] = []

    class Renderer(render.Renderer):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            renderers.append(self)

    Renderer.render = timed_render  # type: ignore[method-assign]
    if original_many is not None:
        Renderer.render_many = timed_many
    if spec["client"] == "ours-synthetic":  # ids made from the key: no tokenizer cost (bench_memory.py)

        def synthetic(self: Any, row: Any, path: str = "<prompts>") -> list[int]:
            return [3 + byte % 200 for byte in row.key.encode()]

        Renderer.render = synthetic  # type: ignore[method-assign]
    if spec["client"] == "ours-prerendered":
        ids = _prerender(spec)

        def lookup(self: Any, row: Any, path: str = "<prompts>") -> list[int]:
            return ids[row.key]

        Renderer.render = lookup  # type: ignore[method-assign]
    app.Renderer = Renderer  # type: ignore[misc]
    # app.py renders through render_many (chunks of rows); the modes above replace single-row rendering.
    if spec["client"] in ("ours-synthetic", "ours-prerendered"):
        one_row = Renderer.render

        def many(self: Any, rows: Any, path: str = "<prompts>") -> list[Any]:
            return [one_row(self, row, path) for row in rows]

        Renderer.render_many = many  # type: ignore[method-assign]
    options: dict[str, Any] = {
        "prompts": Path(spec["prompts"]),
        "out": Path(spec["out"]),
        "tokenizer": Path(spec["tokenizer"]),
        "server_url": (spec["url"],),
        "max_new_tokens": spec["max_new_tokens"],
        "progress": False,
        "preflight": False,
        "concurrency": spec.get("concurrency"),
    }
    outcome = app.run_command(options)
    if outcome.exit_code != 0:
        raise SystemExit(f"run ended with {outcome.exit_code}: {outcome.summary}")
    output_tokens = _count_output_tokens(Path(spec["out"])) if spec.get("count_tokens", True) else 0
    result = window.result(output_tokens)
    rows = render_cpu["rows"]
    result["render_cpu_s_per_1000"] = 1000 * render_cpu["s"] / rows if rows else None
    return result


def _prerender(spec: dict[str, Any]) -> dict[str, list[int]]:
    from eagle_datagen.inputs.prompts import PromptReader
    from eagle_datagen.inputs.render import Renderer, load_tokenizer

    renderer = Renderer(load_tokenizer(Path(spec["tokenizer"])))
    return {row.key: renderer.render(row) for row in PromptReader(Path(spec["prompts"]))}


def _count_output_tokens(out: Path) -> int:
    total = 0
    for path in (out / "shards").glob("shard_*.jsonl*"):
        with path.open("rb") as handle:
            for line in handle:
                total += len(orjson.loads(line)["output_ids"])
    return total


def child_threadpool(spec: dict[str, Any]) -> dict[str, Any]:
    """SpecForge's regenerate_train_data.py loop, with httpx (what the OpenAI client uses) in place of
    ``openai`` (not installed here; its pydantic parsing would only add CPU)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    import httpx

    from eagle_datagen.inputs.prompts import parse_row

    window = Window()
    url = spec["url"]
    shared = httpx.Client(base_url=url, timeout=3600) if spec["client"] == "threadpool-shared" else None
    concurrency = spec["concurrency"]
    output_tokens = [0]
    errors: list[str] = []

    def call(data: dict[str, Any]) -> dict[str, Any]:
        body = {
            "model": "default",
            "messages": data["conversations"],
            "max_tokens": spec["max_new_tokens"],
            "temperature": 0.0,
            "stream": False,
        }
        window.on_send()
        try:  # SpecForge records a failed call as {"status": "error"} and moves on
            if shared is None:
                with httpx.Client(base_url=url, timeout=3600) as client:  # SpecForge: OpenAI(...) per call
                    response = client.post("/v1/chat/completions", json=body)
            else:
                response = shared.post("/v1/chat/completions", json=body)
            response.raise_for_status()
        except Exception as exc:
            errors.append(repr(exc))
            return {**data, "status": "error", "error": str(exc)}
        finally:
            window.on_response()
        payload = response.json()
        output_tokens[0] += payload["usage"]["completion_tokens"]
        text = payload["choices"][0]["message"]["content"]
        data["conversations"] = [*data["conversations"], {"role": "assistant", "content": text}]
        data["status"] = "success"
        return data

    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    executor = ThreadPoolExecutor(max_workers=concurrency)
    waiting: list[Future[dict[str, Any]]] = []
    with Path(spec["prompts"]).open("rb") as source, (out / "regen.jsonl").open("w") as sink:
        for line_no, raw in enumerate(source, start=1):
            if spec.get("limit") and line_no > spec["limit"]:
                break
            row = parse_row(raw, spec["prompts"], line_no)
            data = {"id": row.key, "conversations": row.messages}
            while len(waiting) >= concurrency:  # SpecForge polls its futures in a loop
                finished = False
                for future in waiting:
                    if future.done():
                        sink.write(json.dumps(future.result(), ensure_ascii=False) + "\n")
                        waiting.remove(future)
                        finished = True
                        break
                if finished:
                    break
            waiting.append(executor.submit(call, data))
        for future in waiting:
            sink.write(json.dumps(future.result(), ensure_ascii=False) + "\n")
    executor.shutdown()
    result = window.result(output_tokens[0])
    result.update(errors=len(errors), first_error=errors[0] if errors else None)
    return result


def child_main(spec: dict[str, Any]) -> None:
    pin(spec.get("core"))
    run = child_threadpool if spec["client"].startswith("threadpool") else child_ours
    if spec.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        result = profiler.runcall(run, spec)
        profiler.dump_stats(spec["profile"])
    else:
        result = run(spec)
    result["client"] = spec["client"]
    print(json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------------


def fake_config(args: argparse.Namespace, vocab: int, eos: int) -> dict[str, Any]:
    config: dict[str, Any] = {"vocab_size": vocab, "eos_id": eos, "fixed_output_len": args.output_len}
    if args.mode == "capacity":
        config.update(
            capacity=args.capacity,
            max_running_requests=args.capacity,
            time_per_token_s=args.time_per_token_s,
        )
        if args.output_len_min is not None:
            config.update(fixed_output_len=None, output_len_min=args.output_len_min, output_len_max=args.output_len)
    return config


def bench(args: argparse.Namespace) -> dict[str, Any]:
    client_core, server_core = cpu_cores()
    work = Path(tempfile.mkdtemp(prefix="bench-client-", dir=args.work))
    entries = [(c if t == "h11" else f"{c}+{t}", c, t) for c in args.clients for t in args.transports]
    entries = [e for e in entries if e[2] == "h11" or e[1] in OURS]  # the threadpool clients use httpx
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in entries}
    try:
        tokenizer = tiny_tokenizer(work)
        vocab, eos = tokenizer_ids(tokenizer)
        prompts = write_prompts(work / "prompts.jsonl", args.requests, distinct=args.distinct)
        config = fake_config(args, vocab, eos)
        default_c = None
        with FakeServer(config, work, server_core) as fake:
            for repeat in range(args.repeat):
                order = entries if repeat % 2 == 0 else list(reversed(entries))
                for label, client, transport in order:
                    out = work / f"out-{client}-{transport}-{repeat}"
                    fake.reset()
                    server_cpu = fake.cpu_s()
                    concurrency = args.concurrency
                    if client == "ours-c=B":
                        concurrency = args.capacity if args.mode == "capacity" else 128
                    if client.startswith("threadpool") and concurrency is None:
                        concurrency = default_c or _default_concurrency(config)
                    spec = {
                        "client": client, "prompts": str(prompts), "tokenizer": str(tokenizer), "url": fake.url,
                        "out": str(out), "max_new_tokens": args.output_len, "concurrency": concurrency,
                        "core": client_core,
                        "limit": args.threadpool_requests if client == "threadpool" else None,
                        "profile": str(args.profile / f"{label}-{repeat}.prof") if args.profile else None,
                        "transport": transport,
                    }  # fmt: skip
                    result = run_child(spec)
                    time.sleep(0.2)
                    stats = fake.stats()
                    result["server_responses"] = stats["generate_responses"]
                    span = stats["last_response_t"] - stats["first_request_t"]
                    result["server_cpu_share"] = (fake.cpu_s() - server_cpu) / span if span > 0 else None
                    result["concurrency"] = concurrency or _default_concurrency(config)
                    if args.mode == "capacity":
                        result["utilisation"] = utilisation(stats, args.capacity, args.requests)
                    results[label].append(result)
                    print(_line(label, result, args.mode), flush=True)
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return {"machine": machine(), "argv": sys.argv, "mode": args.mode, "results": results}


def _default_concurrency(config: dict[str, Any]) -> int:
    from eagle_datagen.server.facts import default_concurrency

    return default_concurrency([config.get("max_running_requests", 128)])


def _line(client: str, r: dict[str, Any], mode: str) -> str:
    text = (
        f"{client:22s} {r['responses']:6d} responses in {r['wall_s']:6.2f} s: {r['responses_per_s']:7.0f}/s, "
        f"{r['output_tokens_per_s'] / 1e6:5.2f} M tok/s, CPU {r['cpu_s_per_1000']:.3f} s/1000 "
        f"({100 * r['cpu_share']:.0f}% of a core), RSS {r['max_rss_mb']:.0f} MB, "
        f"server {100 * (r.get('server_cpu_share') or 0):.0f}% of a core"
    )
    if r.get("errors"):
        text += f", {r['errors']} failed requests ({r['first_error']})"
    if r.get("render_cpu_s_per_1000") is not None:
        text += f", render {r['render_cpu_s_per_1000']:.3f} s/1000"
    if mode == "capacity":
        u = r["utilisation"]
        text += (
            f"\n{'':22s} c={r['concurrency']}: utilisation while work remains {100 * u['while_work_remains']:.2f}%, "
            f"last 10% {100 * u['last_10pct']:.2f}%, whole run {100 * u['whole_run']:.2f}%, "
            f"max waiting {u['max_waiting']}"
        )
    return text


def summarize(report: dict[str, Any]) -> None:
    print(f"\n{report['machine']}\nmedians over repeats (ratio to the first client):")
    results = report["results"]
    base = None
    for client, runs in results.items():
        if not runs:
            continue
        rps = statistics.median(r["responses_per_s"] for r in runs)
        cpu = statistics.median(r["cpu_s_per_1000"] for r in runs)
        spread = (max(r["responses_per_s"] for r in runs) - min(r["responses_per_s"] for r in runs)) / rps
        base = base or (rps, cpu)
        text = (
            f"  {client:22s} {rps:7.0f} responses/s (spread {100 * spread:.0f}%, ×{rps / base[0]:.2f}), "
            f"CPU {cpu:.3f} s/1000 (×{cpu / base[1]:.2f})"
        )
        if report["mode"] == "capacity":
            work = statistics.median(r["utilisation"]["while_work_remains"] for r in runs)
            whole = statistics.median(r["utilisation"]["whole_run"] for r in runs)
            tail = statistics.median(r["utilisation"]["last_10pct"] for r in runs)
            text += (
                f", utilisation {100 * work:.2f}% while work remains (tail {100 * tail:.2f}%, run {100 * whole:.2f}%)"
            )
        print(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        child_main(json.loads(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["instant", "capacity"])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--output-len", type=int, default=1000, help="output ids per response (max when varied)")
    parser.add_argument("--output-len-min", type=int, help="capacity mode: vary output lengths from this")
    parser.add_argument("--capacity", type=int, default=64, help="capacity mode: requests served at once (B)")
    parser.add_argument("--time-per-token-s", type=float, default=0.0005)
    parser.add_argument("--concurrency", type=int, help="--concurrency for our client [from the server]")
    parser.add_argument("--clients", nargs="+", default=None, choices=[*OURS, "threadpool", "threadpool-shared"])
    parser.add_argument(
        "--distinct", type=int, help="distinct conversations (ids stay unique) [2000 in instant mode, all otherwise]"
    )
    parser.add_argument(
        "--threadpool-requests", type=int, default=500, help="requests for `threadpool` (a new client per call is slow)"
    )
    parser.add_argument(
        "--transports",
        nargs="+",
        default=["h11"],
        choices=["h11", "legacy"],
        help="/generate transports for our clients: h11 (today's) and/or legacy (the hand-written parser of 0.1, "
        "scripts/legacy_transport.py); each client runs once per transport, side by side [h11]",
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--work", default=None, help="scratch directory [the system temp dir]")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--profile", type=Path, help="run each client under cProfile, stats into this directory")
    args = parser.parse_args(argv)
    if args.distinct is None and args.mode == "instant":
        args.distinct = 2000
    if args.clients is None:
        args.clients = (
            ["ours", "ours-batched", "ours-prerendered", "threadpool", "threadpool-shared"]
            if args.mode == "instant"
            else ["ours", "ours-batched", "ours-c=B", "threadpool-shared"]
        )
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    report = bench(args)
    summarize(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
