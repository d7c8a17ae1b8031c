"""The engine side of a turn: the turn core's engine calls (`turns`: admit, route, call, continue a
partial rollout), SGLang's `/generate` client (`engine_client`) and its typed values (`generation`),
partial rollouts joined (`partial`), the pause gate of weight syncs (`pause`), and which worker a
call goes to (`routing`, `placement`).
"""
