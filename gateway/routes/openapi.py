"""`GET /openapi.json`: an OpenAPI 3.1 document of the routes, for clients and fuzzers (schemathesis).

Request schemas come from the pydantic models in gateway/protocol.py (JSON Schema 2020-12, which
OpenAPI 3.1 uses as is); every error response is the OpenAI error object.
"""
from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from core.sampling.params import (MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS,
                                  MAX_STOP_CHARS, MAX_STOP_STRINGS)
from gateway.protocol import MAX_ALLOWED_TOKEN_IDS, MAX_STOP_TOKEN_IDS, ChatCompletionRequest, CompletionRequest
from gateway.routes.responses_api import MAX_METADATA, ResponsesRequest
from gateway.inputs.reasoning_effort import REASONING_EFFORTS
from gateway.routes.responses_fields import LOGPROBS_INCLUDE, MAX_TOP_LOGPROBS
from gateway.routes.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

REF = "#/components/schemas/{model}"
_NULLABLE_STR = {"type": ["string", "null"]}
_NULL = {"type": "null"}

_ERROR = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": _NULLABLE_STR,
                       "code": _NULLABLE_STR}}},
}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
          "properties": {**{k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                         "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"], "properties": {
                             "cached_tokens": {"type": "integer", "minimum": 0}}}}}
_FINISH = {"enum": ["stop", "length", None]}
_CHAT_FINISH = {"enum": ["stop", "length", "tool_calls", None]}   # tool_calls: a chat answer with tools
_STOP_REASON = {"type": ["string", "integer", "null"]}   # vLLM's: the stop string or stop token id that matched
# vLLM's `return_token_ids`: a prompt's or a choice's ids, null unless asked (gateway/outputs/token_ids.py)
_IDS = {"anyOf": [{"type": "array", "items": {"type": "integer", "minimum": 0}}, _NULL]}
_COMPLETION = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {"id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
                   "model": {"type": "string"}, "usage": {"$ref": "#/components/schemas/Usage"},
                   "choices": {"type": "array", "items": {
                       "type": "object", "required": ["index", "text", "finish_reason"],
                       "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                      "finish_reason": _FINISH, "stop_reason": _STOP_REASON,
                                      "prompt_token_ids": _IDS, "token_ids": _IDS}}}},
}
_CHAT = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {"id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
                   "model": {"type": "string"}, "usage": {"$ref": "#/components/schemas/Usage"},
                   "prompt_token_ids": _IDS,
                   "choices": {"type": "array", "items": {
                       "type": "object", "required": ["index", "message", "finish_reason"],
                       "properties": {"index": {"type": "integer"}, "finish_reason": _CHAT_FINISH,
                                      "stop_reason": _STOP_REASON, "token_ids": _IDS,
                                      "message": {"type": "object", "required": ["role", "content"]}}}}},
}
_MODEL_LIST = {
    "type": "object", "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object", "created", "owned_by", "root", "parent"],
        "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                       "owned_by": {"type": "string"}, "root": {"type": "string"}, "parent": _NULLABLE_STR,
                       "lora_state": {"enum": ["loaded", "available"]}}}}},
}
_TOKENIZED = {"type": "object", "required": ["count", "max_model_len", "tokens"],
              "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                             "tokens": {"type": "array", "items": {"type": "integer"}}}}
_DETOKENIZED = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
# one server-sent event (as OpenAPI 3.2's `itemSchema` for text/event-stream; 3.1 tools read `schema` per event):
# `data` holds a chunk's JSON, an in-band error object, or `[DONE]`
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer"}}}
_LOAD = {"type": "object", "required": ["lora_name", "lora_path"], "additionalProperties": False,
         "properties": {"lora_name": {"type": "string", "minLength": 1},
                        "lora_path": {"type": "string", "minLength": 1}}}
_UNLOAD = {"type": "object", "required": ["lora_name"], "additionalProperties": False,
           "properties": {"lora_name": {"type": "string", "minLength": 1}}}

_ERROR_TEXT = {400: "Invalid request", 401: "Missing or wrong key", 404: "Unknown model (or not the caller's)",
               408: "Request timeout", 413: "Body too large", 429: "Rate, concurrency or queue limit (see Retry-After)",
               503: "Shutting down or engine unavailable"}


# what the field validators of gateway/protocol.py and gateway/inputs/params.py accept, where pydantic's schema is wider
# (unsupported OpenAI fields exist only to be rejected with a clear 400)
_NARROWER: dict[str, dict[str, Any]] = {
    # best_of == n (gateway/inputs/params.py)
    "suffix": _NULL, "best_of": {"anyOf": [{"type": "integer", "minimum": 1}, _NULL]},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]},
                              {"type": "object", "required": ["type", "function"]}, _NULL]},
    "presence_penalty": {"anyOf": [{"type": "number", "minimum": -2, "maximum": 2}, _NULL]},
    "frequency_penalty": {"anyOf": [{"type": "number", "minimum": -2, "maximum": 2}, _NULL]},
    "repetition_penalty": {"anyOf": [{"type": "number", "minimum": 0.01, "maximum": 100}, _NULL]},
    "min_p": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, _NULL]},
    "min_tokens": {"anyOf": [{"type": "integer", "minimum": 0}, _NULL]},
    "logit_bias": {"anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]+$"},
                              "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}, _NULL]},
    "max_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, _NULL]},
    "max_completion_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, _NULL]},
    "stop_token_ids": {"anyOf": [{"type": "array", "maxItems": MAX_STOP_TOKEN_IDS,
                                  "items": {"type": "integer", "minimum": 0}}, _NULL]},
    "temperature": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 100}, _NULL]},
    "allowed_token_ids": {"anyOf": [{"type": "array", "minItems": 1, "maxItems": MAX_ALLOWED_TOKEN_IDS,
                                     "items": {"type": "integer", "minimum": 0}}, _NULL]},
    "bad_words": {"anyOf": [{"type": "array", "maxItems": MAX_BAD_WORDS,
                             "items": {"type": "string", "minLength": 1, "maxLength": MAX_BAD_WORD_CHARS}}, _NULL]},
    "reasoning_effort": {"anyOf": [{"enum": list(REASONING_EFFORTS)}, _NULL]},
    "cache_salt": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS}, _NULL]},
    "truncate_prompt_tokens": {"anyOf": [{"type": "integer", "minimum": -1, "maximum": 2**31 - 1,
                                          "not": {"const": 0}}, _NULL]},
    "top_p": {"anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 1}, _NULL]},
    "stop": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                       {"type": "array", "maxItems": MAX_STOP_STRINGS,
                        "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}}, _NULL]},
    "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}},
                         {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                         {"type": "array", "minItems": 1,
                          "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}}]},
}


def _requires(field: str, other: str, value: Any) -> dict[str, Any]:
    """`field` set (not null) only together with `other` == value."""
    return {"if": {"required": [field], "properties": {field: {"not": _NULL}}},
            "then": {"required": [other], "properties": {other: {"const": value}}}}


def _narrow(schema: dict[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties", {})
    for name, narrower in _NARROWER.items():
        if name in properties:
            properties[name] = {**narrower, **{k: v for k, v in properties[name].items() if k in ("title",)}}
    rules = [_requires("stream_options", "stream", True)]
    if "top_logprobs" in properties:
        rules.append(_requires("top_logprobs", "logprobs", True))
    schema["allOf"] = rules
    return schema


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": _ERROR_TEXT[s], "content": {"application/json": {"schema": _ref("Error")}}}
            for s in statuses}


def _generation(summary: str, body: str, result: str, secured: bool) -> dict[str, Any]:
    ok = {"description": "The result, or server-sent events (`data: {chunk}` ... `data: [DONE]`) when stream is true",
          "content": {"application/json": {"schema": _ref(result)}, "text/event-stream": {"schema": _SSE_EVENT}}}
    statuses = (400, 401, 404, 408, 413, 429, 503) if secured else (400, 404, 408, 413, 429, 503)
    return {"post": {"summary": summary, "operationId": summary.replace(" ", "_").lower(),
                     "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}},
                     "responses": {"200": ok, **_errors(*statuses)}}}


def _tokenizer_route(summary: str, body: str, result: str, secured: bool) -> dict[str, Any]:
    ok = {"description": "OK", "content": {"application/json": {"schema": _ref(result)}}}
    statuses = (400, 401, 404, 413) if secured else (400, 404, 413)
    return {"post": {"summary": summary, "operationId": summary.lower(),
                     "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}},
                     "responses": {"200": ok, **_errors(*statuses)}}}


def _get(summary: str, content: dict[str, Any], errors: tuple[int, ...] = ()) -> dict[str, Any]:
    return {"get": {"summary": summary, "operationId": summary.replace(" ", "_").lower(),
                    "responses": {"200": {"description": "OK", "content": content}, **_errors(*errors)}}}


def _admin(summary: str, body: str) -> dict[str, Any]:
    ok = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    return {"post": {"summary": summary, "operationId": summary.replace(" ", "_").lower(),
                     "security": [{"adminToken": []}],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}},
                     "responses": {"200": ok, **_errors(400, 401, 404, 503)}}}


def openapi_document(admin: bool = False, secured: bool = False) -> dict[str, Any]:
    _, defs = models_json_schema([(CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
                                  (TokenizeCompletionRequest, "validation"), (TokenizeChatRequest, "validation"),
                                  (DetokenizeRequest, "validation"), (ResponsesRequest, "validation")],
                                 ref_template=REF)
    schemas: dict[str, Any] = dict(defs["$defs"])
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schemas[name] = _narrow(schemas[name])
    responses = schemas["ResponsesRequest"]["properties"]
    responses["metadata"] = {   # pydantic writes a dict's max_length as maxLength
        "anyOf": [{"type": "object", "maxProperties": MAX_METADATA, "additionalProperties": {"type": "string"}}, _NULL]}
    # gateway/routes/responses_fields.py: the one include value served, OpenAI's top_logprobs bound, no summary
    responses["include"] = {"anyOf": [{"type": "array", "maxItems": 16, "items": {"const": LOGPROBS_INCLUDE}}, _NULL]}
    responses["top_logprobs"] = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}, _NULL]}
    responses["reasoning"] = {"anyOf": [{"type": "object", "additionalProperties": False, "properties": {
        "effort": {"enum": [*REASONING_EFFORTS, None]}, "summary": _NULL, "generate_summary": _NULL}}, _NULL]}
    # completions: max_tokens 0 only with echo (the prompt scored, nothing generated) and no max_completion_tokens
    completion = schemas["CompletionRequest"]
    completion["properties"]["max_tokens"] = {"anyOf": [{"type": "integer", "minimum": 0}, _NULL]}
    completion["allOf"].append({"if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
                                "then": {"required": ["echo"], "properties": {"echo": {"const": True},
                                                                              "max_completion_tokens": _NULL}}})
    # what grammar/ checks once type is json_schema: a schema object and an OpenAI-style name
    json_schema = {"not": _NULL, "required": ["schema"],
                   "properties": {"schema": {"type": "object"}, "name": {"pattern": "^[a-zA-Z0-9_-]{1,64}$"}}}
    schemas["ResponseFormat"]["allOf"] = [{"if": {"properties": {"type": {"const": "json_schema"}}},
                                          "then": {"required": ["json_schema"],
                                                   "properties": {"json_schema": json_schema}}}]
    schemas.update(Error=_ERROR, Usage=_USAGE, Completion=_COMPLETION, ChatCompletion=_CHAT, ModelList=_MODEL_LIST,
                   Model=_MODEL_LIST["properties"]["data"]["items"], Tokenized=_TOKENIZED, Detokenized=_DETOKENIZED,
                   Response={"type": "object", "required": ["id", "object", "status", "output"]},
                   TokenizeRequest={"anyOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]})
    paths: dict[str, Any] = {
        "/v1/completions": _generation("Create completion", "CompletionRequest", "Completion", secured),
        "/v1/chat/completions": _generation("Create chat completion", "ChatCompletionRequest", "ChatCompletion",
                                            secured),
        "/v1/models": _get("List models", {"application/json": {"schema": _ref("ModelList")}},
                           (401,) if secured else ()),
        "/v1/models/{model_id}": _get("Retrieve model", {"application/json": {"schema": _ref("Model")}},
                                      (401, 404) if secured else (404,)),
        "/tokenize": _tokenizer_route("Tokenize", "TokenizeRequest", "Tokenized", secured),
        "/detokenize": _tokenizer_route("Detokenize", "DetokenizeRequest", "Detokenized", secured),
        "/v1/responses": _generation("Create response", "ResponsesRequest", "Response", secured),
        "/health": _get("Health", {"application/json": {"schema": {"type": "object"}}}, (503,)),
        "/health/live": _get("Liveness", {"application/json": {"schema": {"type": "object"}}}, (503,)),
        "/ping": _get("Ping", {"application/json": {"schema": {"type": "object"}}}, (503,)),
        "/version": _get("Version", {"application/json": {"schema": {
            "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}}),
        "/metrics": _get("Metrics", {"text/plain": {"schema": {"type": "string"}}}),
        "/load": _get("Server load", {"application/json": {"schema": {
            "type": "object", "required": ["server_load"],
            "properties": {"server_load": {"type": "integer", "minimum": 0}}}}}),
    }
    paths["/v1/models/{model_id}"]["get"]["parameters"] = [
        {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    for path in ("/health", "/health/live", "/metrics", "/ping", "/version", "/load"):
        paths[path]["get"]["security"] = []
    security_schemes: dict[str, Any] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    if admin:
        schemas.update(LoadLoraAdapterRequest=_LOAD, UnloadLoraAdapterRequest=_UNLOAD)
        paths["/v1/load_lora_adapter"] = _admin("Load LoRA adapter", "LoadLoraAdapterRequest")
        paths["/v1/unload_lora_adapter"] = _admin("Unload LoRA adapter", "UnloadLoraAdapterRequest")
        security_schemes["adminToken"] = {"type": "http", "scheme": "bearer"}
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "loraplex", "version": "0.1.0",
                 "description": "OpenAI-compatible multi-LoRA serving (completions, chat, models, tokenize)."},
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": security_schemes},
    }
    if secured:
        document["security"] = [{"apiKey": []}]
    return document
