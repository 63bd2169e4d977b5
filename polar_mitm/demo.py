"""README's main job: serve a real small model on CPU and show what the gateway will record for each call."""

from __future__ import annotations

import time

import httpx
from rich.console import Console
from rich.table import Table

from polar_mitm import procs


def print_chat(engine_url: str, prompt: str, *, max_tokens: int, temperature: float, console: Console) -> dict:
    """One chat request with SGLang's token-id extensions; prints text, ids and logprobs."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{engine_url}/v1", api_key="polar-demo")
    started = time.perf_counter()
    completion = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=temperature, logprobs=True,
        extra_body={"return_token_ids": True, "return_meta_info": True},
    )
    elapsed = time.perf_counter() - started
    choice = completion.choices[0]
    extra = choice.model_extra or {}
    prompt_ids, response_ids = extra.get("prompt_token_ids", []), extra.get("response_token_ids", [])
    logprobs = [entry.logprob for entry in choice.logprobs.content]
    console.print(f"[bold]user:[/] {prompt}")
    console.print(f"[bold]{completion.model}:[/] {choice.message.content}")
    table = Table(title=f"{len(response_ids)} sampled tokens (prompt: {len(prompt_ids)} tokens, "
                        f"finish: {choice.finish_reason}, {elapsed:.2f}s)")
    table.add_column("#", justify="right")
    table.add_column("token id", justify="right")
    table.add_column("text")
    table.add_column("logprob", justify="right")
    for i, (tid, entry) in enumerate(zip(response_ids, choice.logprobs.content, strict=True)):
        table.add_row(str(i), str(tid), repr(entry.token), f"{entry.logprob:.4f}")
    console.print(table)
    meta = extra.get("meta_info", {})
    console.print(f"weight_version={meta.get('weight_version')} prefill={meta.get('prefill_latency', 0):.3f}s "
                  f"decode={meta.get('decode_latency', 0):.3f}s sum(logprobs)={sum(logprobs):.3f}")
    return {"prompt_ids": prompt_ids, "response_ids": response_ids, "logprobs": logprobs,
            "text": choice.message.content}


def run_demo(*, model: str, prompt: str, port: int, console: Console) -> None:
    with console.status(f"starting the embedded engine with {model} (first run converts the model once)…"):
        proc, url = procs.start_engine(model, port=port or None)
    try:
        console.print(f"[green]engine up[/] at {url} — {httpx.get(f'{url}/model_info').json()['served_model_name']}")
        print_chat(url, prompt, max_tokens=48, temperature=0.0, console=console)
    finally:
        procs.stop(proc)
