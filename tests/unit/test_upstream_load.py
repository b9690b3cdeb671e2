"""Reading an upstream's load from its Prometheus exposition (vLLM's and SGLang's names)."""

from __future__ import annotations

from gateway.dispatch.load import Load, parse_load

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 0.0
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 6.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 2.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
"""


def test_vllm_load_is_summed_over_engines_with_the_fullest_kv_cache() -> None:
    assert parse_load(VLLM) == Load(waiting=4, running=5, kv_used_fraction=0.75)


def test_sglang_names_are_read_too() -> None:
    assert parse_load(SGLANG) == Load(waiting=2, running=6, kv_used_fraction=0.5)


def test_older_vllm_kv_name_and_unknown_servers() -> None:
    old = 'vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
    assert parse_load(old) == Load(waiting=0, running=1, kv_used_fraction=0.5)
    assert parse_load("process_cpu_seconds_total 12.0\n") is None
    assert parse_load("") is None


def test_the_adapters_vllm_reports_are_its_latest_lora_requests_info() -> None:
    """vLLM adds a sample per change, its value the time: the latest one counts."""
    info = (
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",'
        'waiting_lora_adapters=""} 1.7e9\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",'
        'waiting_lora_adapters="c"} 1.8e9\n'
    )
    load = parse_load(VLLM + info)
    assert load is not None and load.adapters == {"a", "b", "c"}
    plain = parse_load(VLLM)
    assert plain is not None and plain.adapters == frozenset()
