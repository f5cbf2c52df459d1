"""The OpenAI Realtime GA dialect of ``/v1/realtime`` (docs/openai-realtime.md).

Selected per connection at the upgrade (:func:`.dialect.wants_openai`); the existing dialect
(docs/protocol.md) stays the default and unchanged. Modules: ``dialect`` (selection and
credentials), ``session_config`` (the GA session object), ``audio`` (formats and streaming
resamplers), ``items`` (GA objects), ``timeline`` (turns and responses from the model's
continuous timeline), ``errors`` (the GA error shape), ``connection`` (the dispatch).
"""
