"""A request's way into the serving engine and its tokens' way back (`Admission.stream`): refused while no grid
serves (after waiting up to serve.unavailable_wait_s), when the scheduler is full or the request is invalid; once
accepted, the iteration loop is started if idle and the request's stream yields its text as the loop completes
tokens (woken through `RequestEvents`). A request with a grammar has it compiled first (k3ray.serve.grammar:
refused past serve.grammar_compile_s). Ending the stream, however it ends, cancels the request and frees its pages
and slot."""
from __future__ import annotations

from k3ray.config import ServeConfig
from k3ray.model.sampling import SamplingParams
from k3ray.serve.availability import Availability
from k3ray.serve.grammar import GrammarError, Grammars
from k3ray.serve.iterations import IterationLoop
from k3ray.serve.scheduler import Overloaded, Scheduler
from k3ray.serve.streams import RequestEvents


class Admission:
    def __init__(self, serve: ServeConfig, sched: Scheduler, availability: Availability, loop: IterationLoop,
                 events: RequestEvents):
        self.serve, self.sched, self.availability, self.loop, self.events = serve, sched, availability, loop, events
        self.grammars = Grammars(sched.tokenizer, serve.grammar_compile_s)

    async def stream(self, prompt: list[int], params: SamplingParams):
        """A request's items: {'accepted': id} or {'error': 'overloaded' | 'invalid', 'message'} or {'error':
        'unavailable', 'message', 'retry_after'} (no grid served within serve.unavailable_wait_s), then items
        {'text': new final text, 'tokens': the token ids it came from, 'finish': None | 'stop' | 'length'}, or
        {'error': 'internal', ...}; the last item carries 'cached_tokens' (the prompt tokens taken from the prefix
        cache: OpenAI's usage.prompt_tokens_details.cached_tokens); with params.logprobs, items carry 'logprobs' too
        (one per token: k3ray.model.sampling.token_logprobs's). 'invalid' errors may name the request field ('param')
        and the front door's status ('status': 501 for a grammar on a server without xgrammar). The text never ends
        inside a character nor in what a stop string may still cut (the request's detokenizer holds that back)."""
        if (why := await self.availability.unavailable()) is not None:
            yield {"error": "unavailable", "message": f"no serving grid: {why}",
                   "retry_after": self.serve.retry_after_s}
            return
        try:
            grammar = None if params.grammar is None else await self.grammars.compile(params.grammar)
            req = self.sched.submit(prompt, params, grammar)
        except Overloaded as err:
            yield {"error": "overloaded", "message": str(err)}
            return
        except GrammarError as err:
            yield {"error": "invalid", "message": str(err), "param": err.param, "status": err.status}
            return
        except ValueError as err:
            yield {"error": "invalid", "message": str(err)}
            return
        self.loop.ensure_running()
        event = self.events.open(req.id)
        sent, sent_text, interval = 0, 0, self.serve.stream_interval
        try:
            yield {"accepted": req.id}
            while True:
                await event.wait()
                event.clear()
                if req.finish == "error":
                    yield {"error": "internal", "message": req.error}
                    return
                # one look at the request: the iteration loop runs while this stream waits at its yield, and a
                # token or finish that comes meanwhile is the next item's (its event is set again)
                upto = req.detok.tokens  # ids taken into the text: without end-of-text and what follows a stop
                text, done = req.text, req.done
                if done or len(text) > sent_text and (sent == 0 or upto - sent >= interval):
                    item = {"text": text[sent_text:], "tokens": req.out[sent:upto], "finish": req.finish}
                    if params.logprobs is not None:
                        item["logprobs"] = req.logprobs[sent:upto]
                    if done:
                        item["cached_tokens"] = req.cached_prompt or 0
                    sent, sent_text = upto, len(text)
                    yield item
                if done:
                    return
        finally:  # also when the caller cancels the stream: the request ends and its caches are freed
            self.sched.table.cancel(req.id)
            self.sched.table.forget(req.id)
            self.events.close(req.id)
