import unittest

from mathutils import mean, median


class TestStats(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)

    def test_median_odd(self):
        self.assertEqual(median([3, 1, 2]), 2)

    def test_median_even(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_median_more(self):
        self.assertEqual(median([10]), 10)
        self.assertEqual(median([5, 9]), 7)
        self.assertEqual(median([7, -1, 3, 100, 2]), 3)
        self.assertEqual(median([1.5, 0.5, 2.5, 3.5]), 2.0)
        data = [9, 8, 7]
        median(data)
        self.assertEqual(data, [9, 8, 7], "median must not modify its argument")

    def test_empty(self):
        with self.assertRaises(ValueError):
            median([])


if __name__ == "__main__":
    unittest.main()
