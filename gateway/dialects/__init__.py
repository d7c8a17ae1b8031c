"""The client formats the gateway speaks, each a parser into `dialect.TurnRequest` and a shaper of
`dialect.TurnResult`: OpenAI chat and completions (`openai_request`, `openai_response`), the
Responses API (`responses_api`, `responses_answer`), Anthropic Messages (`anthropic_api`); and what
they share: field checks (`validate`), every public field's fate (`controls`), the chat template's
capabilities (`template_caps`), sealed reasoning (`sealed`) and the OpenAPI schemas (`openapi_schemas`).
"""
