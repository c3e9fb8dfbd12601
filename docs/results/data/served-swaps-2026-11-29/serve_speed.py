"""Requests on a file against plain requests, in one server: did the block checks cost serving time?
12 questions at once on a kvzip 0.1 file of the 1.7K-token logbook, then 12 plain requests at once, 48 new
tokens each (ignore_eos), 3 alternating rounds after a warm-up; generated tokens/s over each round's wall
time, medians. Usage (kvfold's source chosen by PYTHONPATH=TREE/src):
  OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python serve_speed.py OUT_DIR"""
import json, statistics, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import kvfold  # noqa: E402
from kvfold.evaluate.data.logbook import FACTS, build_logbook  # noqa: E402
from tests.integrations.vllm.conftest import start_server  # noqa: E402

out = Path(sys.argv[1]); caches = out / "caches"; caches.mkdir(parents=True, exist_ok=True)
model, tokenizer = kvfold.load_model()
text = build_logbook(tokenizer, 1700)
kvfold.save_context(kvfold.prefill(model, tokenizer, text).compress("kvzip", budget=0.1), caches / "doc.kvc", source_text=text)
del model
server = start_server(caches, out, "--", "--enforce-eager", "--max-num-seqs", "16")
questions = [q for _, q, _ in FACTS]
def burst(on_file: bool) -> float:
    asks = [(("doc" if on_file else None), questions[i % len(questions)] if on_file else f"Write a sentence about the number {i}.") for i in range(12)]
    start = time.perf_counter()
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda a: server.ask(a[0], a[1], max_tokens=48, ignore_eos=True), asks))
    seconds = time.perf_counter() - start
    assert all(status == 200 for status, _ in results), results[0]
    return sum(body["usage"]["completion_tokens"] for _, body in results) / seconds
try:
    server.wait()
    burst(True); burst(False)  # warm-up
    rounds = [(burst(True), burst(False)) for _ in range(3)]
finally:
    server.stop()
files, plain = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
report = {"on the file tok/s": round(files, 1), "plain tok/s": round(plain, 1), "file / plain": round(files / plain, 3),
          "rounds": [[round(a, 1), round(b, 1)] for a, b in rounds]}
(out / "speed.json").write_text(json.dumps(report, indent=2) + "\n"); print(json.dumps(report))
