"""`on_own_thread`: benchmark work runs on a thread that ends, and its result or error comes back."""

import threading

import pytest

from bench.offline_throughput import on_own_thread


def test_the_function_runs_on_another_thread_that_has_ended_and_its_result_comes_back():
    thread, value = on_own_thread(
        lambda offset, step: (threading.current_thread(), offset + step), 40, step=2
    )
    assert value == 42
    assert thread is not threading.current_thread()
    assert not thread.is_alive()


def test_an_exception_raised_by_the_function_is_raised_to_the_caller():
    def fails() -> None:
        raise ValueError("no model")

    with pytest.raises(ValueError, match="no model"):
        on_own_thread(fails)
