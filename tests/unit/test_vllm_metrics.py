"""router.vllm.metrics: what the router reads of a vLLM replica's /metrics."""

from __future__ import annotations

from router.vllm.metrics import cached_by_source, parse_vllm_metrics


def test_parse_vllm_metrics_sums_label_sets_and_ignores_the_rest():
    text = """# HELP vllm:num_requests_running Number of requests
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.375
vllm:num_requests_running_total 99
vllm:time_to_first_token_seconds_bucket{le="0.1"} 7.0
vllm:num_requests_waiting{engine="0"} NaN-garbage
"""
    assert parse_vllm_metrics(text) == {"running": 3.0, "waiting": 4.0, "kv_usage": 0.375}


def test_parse_vllm_metrics_takes_the_host_tier_shares_largest_over_engines():
    from engine_patches.offload import HOST_OCCUPANCY, HOST_RETAINED, PENDING_PREFILL

    text = f"""# TYPE {HOST_OCCUPANCY} gauge
{HOST_OCCUPANCY}{{engine="0",model_name="tiny"}} 0.98
{HOST_OCCUPANCY}{{engine="1",model_name="tiny"}} 0.5
# TYPE {HOST_RETAINED} gauge
{HOST_RETAINED}{{engine="0",model_name="tiny"}} 0.25
# TYPE {PENDING_PREFILL} gauge
{PENDING_PREFILL}{{engine="0",model_name="tiny"}} 3000
{PENDING_PREFILL}{{engine="1",model_name="tiny"}} 500
"""
    # shares: the largest engine's; pending prefill tokens: the replica's total
    assert parse_vllm_metrics(text) == {
        "host_occupancy": 0.98, "host_retained": 0.25, "pending_prefill": 3500.0,
    }  # fmt: skip


def test_malformed_metrics_never_raise_and_timestamps_are_not_values():
    text = (
        "vllm:num_requests_running 2 1700000000000\n"  # a sample with a timestamp
        'vllm:num_requests_waiting{engine="0"} 1\n'
        "vllm:broken_line_without_value\n"
    )
    got = parse_vllm_metrics(text)  # must not raise
    assert got.get("running") in (2.0, None) and got.get("running") != 1700000000000


VLLM_033 = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:prompt_tokens_cached counter
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 700.0
# TYPE vllm:prompt_tokens_cached_by_source counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 500.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 150.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 50.0
"""


def test_cached_tokens_by_tier_from_the_replicas_metrics():
    m = parse_vllm_metrics(VLLM_033)
    assert (m["running"], m["waiting"], m["kv_usage"]) == (3.0, 1.0, 0.5)
    assert {k: v for k, v in m.items() if k.startswith("cached:")} == {
        "cached:device": 500.0, "cached:host": 150.0, "cached:disk": 50.0,
    }  # fmt: skip
    old = parse_vllm_metrics(VLLM_033.split("# TYPE vllm:prompt_tokens_cached_by_source")[0])
    assert old["cached:all"] == 700.0  # vLLM 0.32 does not split by tier
    assert cached_by_source(VLLM_033) == {"device": 500.0, "host": 150.0, "disk": 50.0}
