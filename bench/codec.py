"""Why token ids and logprobs travel as packed bytes, not JSON lists.

One group is 8 samples x 2,048 response tokens + a 512-token prompt, with
float32 logprobs and per-token versions. Side by side, in one run:

  packed  shared.codec.encode_group / decode_group (int32 / float32 bytes,
          zero-copy numpy views on decode, versions run-length encoded)
  json    the same fields, but ids / logprobs / versions as plain lists in one
          orjson document, decoded back to lists. Generous to JSON: the lists
          are built before timing, and decoding builds no records.
  json->records  what JSON would cost for *these* records:
          numpy -> lists -> orjson on encode, orjson -> lists -> Sample/Group
          (numpy arrays) on decode.

For each: encode + decode time per group, payload bytes (field names and
values as sent), and a round trip through a real redis-server (encode, XADD,
XRANGE the entry back, decode). Medians over --repeats, ways interleaved.

    .venv/bin/python bench/codec.py            # ~50 s on 2 cores
    .venv/bin/python bench/codec.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson
import redis
from common import RESULTS as RESULTS_DIR
from workload import PROMPT_TOKENS, RESPONSE_TOKENS, SAMPLES, build_group

from rollstream.shared import codec
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.records import Group, Sample, Status
from rollstream.shared.settings import load_settings

RESULTS = RESULTS_DIR / "codec.json"

Encoded = dict[str, Any]
Raw = dict[bytes, bytes]


def main() -> None:
    args = parse_args()
    groups = [build_group(seed) for seed in range(args.groups)]
    as_lists = [group_as_lists(g) for g in groups]  # JSON's input, built before any timing
    check_round_trips(groups[0], as_lists[0])

    # Each way: (inputs, encode, decode); all timed the same way.
    ways: dict[str, tuple[list[Any], Callable[[Any], Encoded], Callable[[Raw], Any]]] = {
        "packed": (groups, codec.encode_group, codec.decode_group),
        "json": (as_lists, encode_json, decode_json),
        "json->records": (groups, encode_json_from_group, decode_json_to_group),
    }
    sizes = {name: payload_bytes(encode(inputs[0])) for name, (inputs, encode, _) in ways.items()}

    codec_us: dict[str, list[float]] = {name: [] for name in ways}
    redis_us: dict[str, list[float]] = {name: [] for name in ways}
    with EmbeddedRedis() as server:
        client = connect(load_settings(run="bench", redis={"url": server.url}).redis)
        for _ in range(args.repeats):
            for name, (inputs, encode, decode) in ways.items():  # interleaved: one of each per repeat
                codec_us[name].append(time_codec(inputs, encode, decode))
                redis_us[name].append(time_redis(client, inputs, encode, decode))
        client.close()

    result = summarize(args, sizes, codec_us, redis_us)
    print_table(args, result)
    write_json(result)


# --- measurements --------------------------------------------------------------------


def time_codec(inputs: list[Any], encode: Callable[[Any], Encoded], decode: Callable[[Raw], Any]) -> float:
    """Mean µs of encode + decode per group over all inputs (values as Redis returns them)."""
    start = time.perf_counter()
    for item in inputs:
        decode(as_raw(encode(item)))
    return (time.perf_counter() - start) / len(inputs) * 1e6


def time_redis(
    client: redis.Redis,
    inputs: list[Any],
    encode: Callable[[Any], Encoded],
    decode: Callable[[Raw], Any],
) -> float:
    """Mean µs per group of encode, XADD, XRANGE of that entry, decode."""
    stream = "bench:codec"
    client.delete(stream)
    start = time.perf_counter()
    for item in inputs:
        entry_id = client.xadd(stream, encode(item))  # type: ignore[arg-type]
        [(_, fields)] = client.xrange(stream, entry_id, entry_id)  # type: ignore[misc]
        decode(fields)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    client.delete(stream)
    return elapsed / len(inputs) * 1e6


def summarize(
    args: argparse.Namespace,
    sizes: dict[str, int],
    codec_us: dict[str, list[float]],
    redis_us: dict[str, list[float]],
) -> dict[str, Any]:
    def stats(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    codec_stats = {name: stats(v) for name, v in codec_us.items()}
    redis_stats = {name: stats(v) for name, v in redis_us.items()}
    return {
        "shape": {"samples": SAMPLES, "response_tokens": RESPONSE_TOKENS, "prompt_tokens": PROMPT_TOKENS},
        "groups": args.groups,
        "repeats": args.repeats,
        "machine": platform.node(),
        "payload_bytes": sizes,
        "codec_us_per_group": codec_stats,
        "redis_round_trip_us_per_group": redis_stats,
        "codec_us_samples": codec_us,
        "redis_us_samples": redis_us,
        "ratio_json_over_packed": {
            "codec_time": codec_stats["json"]["median"] / codec_stats["packed"]["median"],
            "codec_time_via_records": codec_stats["json->records"]["median"]
            / codec_stats["packed"]["median"],
            "size": sizes["json"] / sizes["packed"],
            "redis_round_trip": redis_stats["json"]["median"] / redis_stats["packed"]["median"],
            "redis_round_trip_via_records": redis_stats["json->records"]["median"]
            / redis_stats["packed"]["median"],
        },
    }


def print_table(args: argparse.Namespace, r: dict[str, Any]) -> None:
    print(
        f"group: {SAMPLES} samples x {RESPONSE_TOKENS} response tokens + {PROMPT_TOKENS} prompt tokens, "
        f"float32 logprobs; {args.groups} groups x {args.repeats} repeats, median [min-max]"
    )
    print(f"{'way':<15}{'payload':>12}{'encode+decode':>28}{'redis round trip':>30}")
    for name, size in r["payload_bytes"].items():
        c = r["codec_us_per_group"][name]
        trip = r["redis_round_trip_us_per_group"][name]
        print(f"{name:<15}{size / 1024:>9.1f} KiB{fmt_us(c):>28}{fmt_us(trip):>30}")
    ratio = r["ratio_json_over_packed"]
    print(
        f"json/packed: time {ratio['codec_time']:.1f}x (via records {ratio['codec_time_via_records']:.1f}x), "
        f"size {ratio['size']:.1f}x, redis round trip {ratio['redis_round_trip']:.1f}x "
        f"(via records {ratio['redis_round_trip_via_records']:.1f}x)"
    )


def fmt_us(s: dict[str, float]) -> str:
    return f"{s['median']:,.0f} µs [{s['min']:,.0f}-{s['max']:,.0f}]"


def write_json(result: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


# --- the data ------------------------------------------------------------------------


def group_as_lists(group: Group) -> dict[str, Any]:
    """The group as a JSON design would hold it: every array a plain list."""
    return {
        "task": group.task,
        "group_id": group.group_id,
        "model_step": group.model_step,
        "status": (group.status or Status.COMPLETED).value,
        "n": group.n,
        "attempt": group.attempt,
        "producer": group.producer,
        "prompt": codec.prompt_to_dict(group.prompt),
        "prompt_ids": group.samples[0].prompt_ids.tolist(),  # once, as the packed codec stores it
        "created_at": group.created_at,
        "timings": group.timings,
        "samples": [
            {
                "response_ids": s.response_ids.tolist(),
                "logprobs": s.logprobs.tolist(),
                "response_versions": s.response_versions.tolist(),
                "finish": s.finish_reason,
                "reward": s.reward,
                "status": s.status.value,
                "text": s.text,
            }
            for s in group.samples
        ],
    }


# --- the JSON way --------------------------------------------------------------------

PLAIN = ("task", "group_id", "model_step", "status", "n", "attempt", "producer")


def encode_json(data: dict[str, Any]) -> Encoded:
    """The plain fields as the packed codec writes them, everything else one orjson document."""
    fields: Encoded = {name: data[name] for name in PLAIN}
    fields["data"] = orjson.dumps(data)
    return fields


def decode_json(fields: Raw) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(fields[b"data"])
    return data


def encode_json_from_group(group: Group) -> Encoded:
    return encode_json(group_as_lists(group))


def decode_json_to_group(fields: Raw) -> Group:
    data = decode_json(fields)
    samples = [
        Sample(
            prompt_ids=data["prompt_ids"],
            response_ids=s["response_ids"],
            logprobs=s["logprobs"],
            response_versions=s["response_versions"],
            finish_reason=s["finish"],
            reward=s["reward"],
            status=s["status"],
            text=s["text"],
        )
        for s in data["samples"]
    ]
    return Group(
        group_id=data["group_id"],
        task=data["task"],
        prompt=codec.prompt_from_dict(data["prompt"]),
        samples=samples,
        model_step=data["model_step"],
        status=data["status"],
        attempt=data["attempt"],
        producer=data["producer"],
        created_at=data["created_at"],
        timings=data["timings"],
    )


# --- helpers -------------------------------------------------------------------------


def as_raw(fields: Encoded) -> Raw:
    """Field values as redis-py sends them and a reply brings them back: bytes."""
    return {name.encode(): to_bytes(value) for name, value in fields.items()}


def to_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, float):
        return repr(value).encode()
    return str(value).encode()


def payload_bytes(fields: Encoded) -> int:
    return sum(len(name) + len(value) for name, value in as_raw(fields).items())


def check_round_trips(group: Group, data: dict[str, Any]) -> None:
    """Both ways give back what went in, before anything is timed."""
    assert codec.decode_group(as_raw(codec.encode_group(group))).samples == group.samples
    assert decode_json(as_raw(encode_json(data))) == data
    assert decode_json_to_group(as_raw(encode_json_from_group(group))).samples == group.samples


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=128, help="distinct groups per repeat")
    parser.add_argument("--repeats", type=int, default=31, help="repeats (medians are over these)")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke size: a few seconds")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.repeats = 4, 3
    return args


if __name__ == "__main__":
    main()
