"""Exploratory: `radixkv serve` with every feature on + the openai SDK: concurrent chat requests
(streamed and not, some streams closed mid-way, n > 1, logprobs, stop, json_schema, tenants via an
API keys file), a flush in the middle and at the end; checks: no 5xx, /health 200, the integrity
check with nothing running, free == capacity after the flush, greedy replies equal across waves
(same prompt, same text up to near-ties). python tests/stress/combo_stress_http.py [--port P]"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import httpx
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from combo_stress import SCHEMA  # noqa: E402


def start(port, keys):
    tmp = tempfile.mkdtemp()
    cmd = [
        sys.executable, "-m", "radixkv", "serve", "--port", str(port), "--device", "cpu",
        "--max-total-tokens", "1024", "--page-size", "16", "--chunked-prefill-size", "48",
        "--kv-cache-dtype", "float32", "--host-cache-bytes", str(64 << 20), "--disk-cache-dir", tmp,
        "--speculative-config", json.dumps({"method": "radix", "num_speculative_tokens": 5}),
        "--max-running-requests", "8", "--api-keys-file", keys,
    ]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        if p.poll() is not None:
            print(p.stdout.read())
            raise SystemExit("server died")
        time.sleep(0.5)
    raise SystemExit("no server")


def one(client, rng, msgs):
    kw = dict(model="smollm2-135m", messages=msgs, max_tokens=rng.choice([1, 8, 20]), temperature=0)
    r = rng.random()
    if r < 0.2:
        kw.update(n=2, temperature=0.8, seed=rng.randrange(100))
    elif r < 0.35:
        kw.update(logprobs=True, top_logprobs=2)
    elif r < 0.45:
        kw.update(stop=["the", "."])
    elif r < 0.55:
        kw.update(
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}, max_tokens=24
        )
    if rng.random() < 0.5:
        with client.chat.completions.create(stream=True, **kw) as s:
            text, cut = "", rng.random() < 0.3
            for i, ch in enumerate(s):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                if cut and i >= 1:
                    return ("cut", None)
            return ("stream", kw["temperature"] == 0 and "n" not in kw, text, sig(kw))
    r = client.chat.completions.create(**kw)
    return ("plain", kw["temperature"] == 0 and "n" not in kw, r.choices[0].message.content, sig(kw))


def sig(kw):
    return json.dumps(
        {k: v for k, v in kw.items() if k not in ("messages", "logprobs", "top_logprobs")}, sort_keys=True
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=31871)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    from radixkv.datasets import load_conversations

    convs = [c[0] for c in load_conversations(12, 1, max_user_chars=500)]
    keys = os.path.join(tempfile.mkdtemp(), "keys.json")
    with open(keys, "w") as f:
        json.dump({"ka": {"tenant": "a", "admin": True}, "kb": {"tenant": "b", "kv_quota_tokens": 128}}, f)
    proc, url = start(args.port, keys)
    clients = {k: openai.OpenAI(base_url=url + "/v1", api_key=k, max_retries=0, timeout=300) for k in ("ka", "kb")}
    greedy = {}
    try:
        for wave in range(args.waves):
            jobs = []
            with cf.ThreadPoolExecutor(6) as ex:
                for _ in range(10):
                    key = rng.choice(["ka", "kb"])
                    q = rng.choice(convs)
                    sub = random.Random(rng.random())
                    jobs.append((q, ex.submit(one, clients[key], sub, [{"role": "user", "content": q}])))
                if wave == 1:
                    r = httpx.post(url + "/flush_cache", headers={"Authorization": "Bearer ka"})
                    print("flush mid-wave", r.status_code)
            for q, f in jobs:
                res = f.result()
                if res[0] != "cut" and res[1]:
                    greedy.setdefault((q, res[3]), set()).add(res[2])
            h = httpx.get(url + "/health")
            st = httpx.get(url + "/cache_stats?check=1", headers={"Authorization": "Bearer ka"})
            print("wave", wave, "health", h.status_code, "stats", st.status_code, st.json().get("running"))
        r = httpx.post(url + "/flush_cache", headers={"Authorization": "Bearer ka"})
        st = httpx.get(url + "/cache_stats?check=1", headers={"Authorization": "Bearer ka"}).json()
        print("flush", r.status_code, "free", st["free"], "capacity", st["capacity"])
        assert st["free"] == st["capacity"], st
        diff = {k: v for k, v in greedy.items() if len(v) > 1}
        print("greedy prompts", len(greedy), "with differing replies", len(diff))
        for k, v in diff.items():
            print("  ", k[0][:40], v)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
        bad = [ln for ln in out.splitlines() if "Traceback" in ln or " 500 " in ln or "ERROR" in ln]
        print("server log problems:", len(bad))
        for ln in bad[:20]:
            print("  ", ln)


if __name__ == "__main__":
    main()
