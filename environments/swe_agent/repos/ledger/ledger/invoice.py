"""An invoice: lines, a discount, tax, and what is still owed."""

from ledger.money import percent_of


class Line:
    def __init__(self, description, unit_cents, quantity=1):
        if quantity < 1:
            raise ValueError("quantity must be at least 1")
        self.description = description
        self.unit_cents = unit_cents
        self.quantity = quantity

    def total(self):
        return self.unit_cents * self.quantity


class Invoice:
    def __init__(self, customer, tax_percent=20, lines=None):
        self.customer = customer
        self.tax_percent = tax_percent
        self.lines = list(lines or [])
        self.discount_percent = 0
        self.payments = []

    def add(self, description, unit_cents, quantity=1):
        self.lines.append(Line(description, unit_cents, quantity))
        return self

    def subtotal(self):
        return sum(line.total() for line in self.lines)

    def set_discount(self, percent):
        if percent < 0 or percent > 100:
            raise ValueError("discount must be between 0 and 100")
        self.discount_percent = percent

    def discount(self):
        return percent_of(self.subtotal(), self.discount_percent)

    def tax(self):
        return percent_of(self.subtotal() - self.discount(), self.tax_percent)

    def total(self):
        return self.subtotal() - self.discount() + self.tax()

    def pay(self, cents):
        if cents <= 0:
            raise ValueError("a payment must be positive")
        self.payments.append(cents)

    def balance(self):
        return self.total() - sum(self.payments)

    def is_paid(self):
        return self.balance() <= 0


def bulk_discount(quantity, tiers=((10, 5), (50, 10), (100, 15))):
    """The discount percent for buying `quantity` units: the highest tier whose minimum it reaches."""
    percent = 0
    for minimum, tier_percent in tiers:
        if quantity >= minimum:
            percent = tier_percent
    return percent
