"""Splitting an amount into instalments and ageing unpaid invoices."""


def instalments(total_cents, count):
    """`total_cents` split into `count` instalments that differ by at most one cent, larger ones first."""
    if count < 1:
        raise ValueError("count must be at least 1")
    base, extra = divmod(total_cents, count)
    return [base + 1 if i < extra else base for i in range(count)]


def due_days(issue_day, terms_days=30):
    """The day number an invoice issued on `issue_day` is due."""
    return issue_day + terms_days


def ageing_bucket(days_overdue):
    """'current' (not overdue), '1-30', '31-60', '61-90' or '90+'."""
    if days_overdue <= 0:
        return "current"
    if days_overdue <= 30:
        return "1-30"
    if days_overdue <= 60:
        return "31-60"
    if days_overdue <= 90:
        return "61-90"
    return "90+"


def ageing_report(invoices, today):
    """Sum of unpaid balances per ageing bucket. `invoices` are (issue_day, terms_days, balance)."""
    report = {"current": 0, "1-30": 0, "31-60": 0, "61-90": 0, "90+": 0}
    for issue_day, terms_days, balance in invoices:
        if balance <= 0:
            continue
        overdue = today - due_days(issue_day, terms_days)
        report[ageing_bucket(overdue)] += balance
    return report


def late_fee(balance_cents, days_overdue, daily_rate_bp=5, cap_percent=10):
    """A late fee of `daily_rate_bp` basis points per day overdue, at most `cap_percent` of the balance."""
    if days_overdue <= 0 or balance_cents <= 0:
        return 0
    fee = balance_cents * daily_rate_bp * days_overdue // 10000
    cap = balance_cents * cap_percent // 100
    return min(fee, cap)
