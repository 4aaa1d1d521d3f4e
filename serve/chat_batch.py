"""vLLM's ``POST /v1/chat/completions/batch``: several conversations in one
request, answered by one chat completion whose choice ``i`` is conversation
``i``'s reply.

Owns splitting the body into conversations, each then validated as a whole
``/v1/chat/completions`` body (so every field means there what it means on
the chat route), and joining their outputs into one response with summed
usage. Admission, the engine and rendering are the chat route's own
(``api.py``, ``render.py``); the conversations run concurrently.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fluidserve.serve.api import _echo_text, validate_body
from fluidserve.serve.inputs import check_model, log_request
from fluidserve.serve.protocol import BatchChatCompletionRequest, ChatCompletionRequest, ChatCompletionResponse
from fluidserve.serve.render import chat_choices, keep_best, make_usage, prediction_tokens


def batch_chat_route(server: Any) -> Callable[[Request], Awaitable[Response]]:
    """The route handler over ``server`` (api.py's ``_Server``)."""

    async def create_batch_chat_completion(request: Request) -> Response:
        return await batch_chat(server, request)

    return create_batch_chat_completion


def conversations(batch: BatchChatCompletionRequest, ignore_unknown_fields: bool = False,
                  ) -> list[ChatCompletionRequest]:
    """One chat request per conversation, with the batch's other fields."""
    shared = dict(batch.model_extra or {})
    return [validate_body({**shared, "messages": [m.model_dump(mode="json", exclude_none=True) for m in conv]},
                          ChatCompletionRequest, ignore_unknown_fields)
            for conv in batch.messages]


async def batch_chat(server: Any, request: Request) -> Response:
    batch = await server.parse(request, BatchChatCompletionRequest)
    reqs = conversations(batch, server.settings.ignore_unknown_fields)
    check_model(reqs[0].model, server.model)
    inputs = [server.processor.chat(req) for req in reqs]
    server.admit_capacity(len(inputs))
    rid = f"chatcmpl-{server.base_request_id(request, reqs[0].request_id)}"
    streams = []
    try:
        for i, one in enumerate(inputs):
            if server.settings.log_requests:
                log_request(f"{rid}_{i}", one, server.settings.max_log_len)
            streams += await server.submit(f"{rid}_{i}", one)
    except BaseException:
        for stream in streams:
            stream.abort()
        raise
    timers = [server.timer(one) for one in inputs]
    finals = await server.until_disconnect(request, server.collect(streams, timers), streams)
    choices = []
    for i, (req, final) in enumerate(zip(reqs, finals)):
        if req.ranked:
            (final,) = keep_best([final], 1)
        (choice,) = chat_choices(final, top_n=req.top_n, decode=server.decode, role=req.reply_role,
                                 echo_text=_echo_text(req), as_ids=server.as_ids(req),
                                 token_ids=bool(req.return_token_ids), reasoning=inputs[i].reasoning)
        choices.append(choice.model_copy(update={"index": i}))
    thought = [server.reasoning_tokens(one, final) for one, final in zip(inputs, finals)]
    usage = make_usage([one.prompts[0] for one in inputs], sum(f.num_generated_tokens for f in finals),
                       server.cached_tokens(finals), None if None in thought else sum(thought),
                       prediction_tokens([co for f in finals for co in f.outputs]))
    body = ChatCompletionResponse(id=rid, model=server.model.reply_name(reqs[0].model), choices=choices, usage=usage)
    return JSONResponse(body.model_dump(mode="json"))
