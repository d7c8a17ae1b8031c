import unittest

from ledger.invoice import Invoice, Line, bulk_discount


class TestInvoice(unittest.TestCase):
    def make(self):
        return Invoice("acme").add("widget", 1000, 3).add("gadget", 250)

    def test_subtotal(self):
        self.assertEqual(self.make().subtotal(), 3250)

    def test_default_tax_is_20_percent(self):
        self.assertEqual(self.make().tax(), 650)

    def test_discount_before_tax(self):
        invoice = self.make()
        invoice.set_discount(10)
        self.assertEqual(invoice.discount(), 325)
        self.assertEqual(invoice.tax(), 585)
        self.assertEqual(invoice.total(), 3510)

    def test_discount_bounds(self):
        invoice = self.make()
        invoice.set_discount(100)
        self.assertEqual(invoice.total(), 0)
        with self.assertRaises(ValueError):
            invoice.set_discount(101)
        with self.assertRaises(ValueError):
            invoice.set_discount(-1)

    def test_payments_and_balance(self):
        invoice = self.make()
        invoice.pay(1000)
        self.assertEqual(invoice.balance(), 2900)
        self.assertFalse(invoice.is_paid())
        invoice.pay(2900)
        self.assertTrue(invoice.is_paid())

    def test_payment_must_be_positive(self):
        with self.assertRaises(ValueError):
            self.make().pay(0)

    def test_line_quantity(self):
        self.assertEqual(Line("x", 300).total(), 300)
        with self.assertRaises(ValueError):
            Line("x", 300, 0)


class TestBulkDiscount(unittest.TestCase):
    def test_tiers(self):
        self.assertEqual(bulk_discount(9), 0)
        self.assertEqual(bulk_discount(10), 5)
        self.assertEqual(bulk_discount(49), 5)
        self.assertEqual(bulk_discount(50), 10)
        self.assertEqual(bulk_discount(150), 15)
