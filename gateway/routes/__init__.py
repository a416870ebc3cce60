"""Routes besides completions and chat (gateway/app.py): /tokenize, /detokenize, /v1/responses, /openapi.json."""
