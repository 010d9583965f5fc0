"""flashlite._intmath against Triton's own constexpr helpers, which launch code used to call."""
import triton

from flashlite._intmath import cdiv, next_power_of_2


def test_cdiv_matches_triton():
    for a in [0, 1, 2, 63, 64, 65, 127, 128, 1000, 100_000, 2**31 + 7]:
        for b in [1, 2, 16, 64, 128, 256]:
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_power_of_2_matches_triton():
    for n in [1, 2, 3, 15, 16, 17, 40, 64, 80, 96, 100, 128, 129, 256, 1000, 1024, 4097, 2**20 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
