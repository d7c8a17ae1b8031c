"""Helpers the test suite shares (test doubles, fixtures); never imported by the product."""
