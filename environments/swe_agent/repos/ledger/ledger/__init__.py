"""ledger: invoices in integer cents."""
