"""The engine queue on a scripted generator: one job at a time in order, a bounded queue, cancel, shutdown."""

import asyncio
import threading

import pytest

from offspec import GenerationResult, OffspecError, TextDelta
from offspec.serve.queue import EngineQueue, Job, QueueFull, ShuttingDown
from tui.fake import FakeGenerator


def messages(text):
    return [{"role": "user", "content": text}]


async def collect(engine, job):
    return [event async for event in engine.events(job)]


async def wait_for(condition, timeout=10.0):
    """Poll a condition of another thread (the engine worker) until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_jobs_run_one_at_a_time_in_order():
    fake = FakeGenerator(lambda m: m[-1]["content"] + " done", tokens_per_pass=1)

    async def main():
        engine = EngineQueue(fake, max_waiting=4)
        engine.start()
        jobs = [Job(messages(f"job{i}"), dict(max_new_tokens=50)) for i in range(3)]
        for job in jobs:
            engine.submit(job)
        results = [await collect(engine, job) for job in jobs]
        assert engine.close(5)
        return jobs, results

    jobs, results = asyncio.run(main())
    for i, events in enumerate(results):
        assert isinstance(events[-1], GenerationResult) and events[-1].text == f"job{i} done"
        assert all(isinstance(e, TextDelta) for e in events[:-1])
    assert [c["prompt"][0]["content"] for c in fake.calls] == ["job0", "job1", "job2"]
    assert jobs[0].started_at <= jobs[1].started_at <= jobs[2].started_at


def test_a_full_queue_refuses_with_a_retry_estimate_and_a_withdrawn_job_frees_its_slot():
    fake = FakeGenerator("one two three four five six", tokens_per_pass=1, hold_after_passes=1)

    async def main():
        engine = EngineQueue(fake, max_waiting=2)
        engine.start()
        running = Job(messages("a"))
        engine.submit(running)
        await wait_for(fake.holding.is_set)  # running, held after its first pass
        waiting = [Job(messages("b")), Job(messages("c"))]
        for job in waiting:
            engine.submit(job)
        assert engine.status() == {"running": 1, "waiting": 2, "max_waiting": 2, "accepting": True}
        with pytest.raises(QueueFull) as full:
            engine.submit(Job(messages("d")))
        assert full.value.retry_after >= 1
        engine.withdraw(waiting[0])  # its client left: the slot is free again
        late = Job(messages("e"))
        engine.submit(late)
        engine.withdraw(running)  # the running job: cancelled after its current pass
        first = await collect(engine, running)
        assert first[-1].stop_reason == "cancelled" and first[-1].n_passes == 1
        for job in (waiting[1], late):
            job.cancel.set()  # let them end at once (the fake holds until cancelled)
        assert engine.close(5)

    asyncio.run(main())
    assert [c["prompt"][0]["content"] for c in fake.calls][:1] == ["a"]
    assert "b" not in [c["prompt"][0]["content"] for c in fake.calls]  # withdrawn before it started


def test_shutdown_refuses_waiting_jobs_and_cancels_the_running_one():
    fake = FakeGenerator("one two three four five six", tokens_per_pass=1, hold_after_passes=1)

    async def main():
        engine = EngineQueue(fake, max_waiting=4)
        engine.start()
        running, waiting = Job(messages("a")), Job(messages("b"))
        engine.submit(running)
        await wait_for(fake.holding.is_set)
        engine.submit(waiting)
        received = []
        events = engine.events(running)
        received.append(await events.__anext__())  # the first pass
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(ShuttingDown, match="not run"):
            await collect(engine, waiting)
        with pytest.raises(ShuttingDown, match="cancelled"):
            async for event in events:
                received.append(event)
        with pytest.raises(ShuttingDown):
            engine.submit(Job(messages("c")))
        assert engine.close(5)
        assert engine.status()["accepting"] is False
        return received

    received = asyncio.run(main())
    assert all(isinstance(e, TextDelta) for e in received) and len(received) == 1
    assert len(fake.calls) == 1


def test_generator_errors_reach_the_request():
    class Refusing(FakeGenerator):
        def stream(self, prompt, **kwargs):
            raise OffspecError("the prompt is 999 tokens but the context limit is 10")
            yield

    async def main():
        engine = EngineQueue(Refusing(), max_waiting=1)
        engine.start()
        job = Job(messages("x"))
        engine.submit(job)
        with pytest.raises(OffspecError, match="context limit"):
            await collect(engine, job)
        ok = Job(messages("y"))  # the worker goes on
        engine.submit(ok)
        with pytest.raises(OffspecError):
            await collect(engine, ok)
        assert engine.close(5)

    asyncio.run(main())


def test_raw_jobs_are_tokenized_by_the_worker_without_the_chat_template():
    class Recording(FakeGenerator):
        tokenized = []

        def tokenize(self, text):
            self.tokenized.append((text, threading.current_thread().name))
            return [1, 2, 3]

        def stream(self, prompt, **kwargs):
            self.prompts.append(prompt)
            return super().stream(messages("ids"), **kwargs)

    fake = Recording("ok")
    fake.prompts = []

    async def main():
        engine = EngineQueue(fake, max_waiting=1)
        engine.start()
        job = Job("raw text", raw=True)
        engine.submit(job)
        await collect(engine, job)
        assert engine.close(5)

    asyncio.run(main())
    assert fake.tokenized == [("raw text", "offspec-engine")]
    assert fake.prompts == [[1, 2, 3]]
