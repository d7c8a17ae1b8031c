"""What the gateway keeps per session: the record (`session`) and the store of them
(`session_store`), the turn tree and its linearisation into samples (`trajectory`), the last parsed
history (`history`), finished sessions packed (`finished`), the durable sample spool (`spool`), the
session journal and its replay after a restart (`journal`, `replay`), and the admission and idle
limits (`limits`).
"""
