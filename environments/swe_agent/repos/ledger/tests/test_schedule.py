import unittest

from ledger.schedule import ageing_bucket, ageing_report, due_days, instalments, late_fee


class TestInstalments(unittest.TestCase):
    def test_even(self):
        self.assertEqual(instalments(900, 3), [300, 300, 300])

    def test_remainder_goes_first(self):
        self.assertEqual(instalments(1001, 3), [334, 334, 333])

    def test_one(self):
        self.assertEqual(instalments(5, 1), [5])
        with self.assertRaises(ValueError):
            instalments(5, 0)


class TestAgeing(unittest.TestCase):
    def test_due(self):
        self.assertEqual(due_days(10), 40)
        self.assertEqual(due_days(10, terms_days=7), 17)

    def test_buckets(self):
        self.assertEqual(ageing_bucket(0), "current")
        self.assertEqual(ageing_bucket(1), "1-30")
        self.assertEqual(ageing_bucket(30), "1-30")
        self.assertEqual(ageing_bucket(31), "31-60")
        self.assertEqual(ageing_bucket(60), "31-60")
        self.assertEqual(ageing_bucket(90), "61-90")
        self.assertEqual(ageing_bucket(91), "90+")

    def test_report(self):
        invoices = [(0, 30, 100), (0, 30, 0), (50, 30, 40), (-100, 30, 7)]
        report = ageing_report(invoices, today=45)
        self.assertEqual(report, {"current": 40, "1-30": 100, "31-60": 0, "61-90": 0, "90+": 7})


class TestLateFee(unittest.TestCase):
    def test_not_overdue(self):
        self.assertEqual(late_fee(10000, 0), 0)
        self.assertEqual(late_fee(0, 10), 0)

    def test_daily(self):
        self.assertEqual(late_fee(10000, 10), 50)

    def test_capped(self):
        self.assertEqual(late_fee(10000, 1000), 1000)
        self.assertEqual(late_fee(10000, 100, cap_percent=2), 200)
