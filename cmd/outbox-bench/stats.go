package main

import (
	"slices"
	"time"
)

// quantile returns the q-quantile (0 ≤ q ≤ 1) of samples by the nearest-rank
// method, without reordering samples. It returns 0 for no samples.
func quantile(samples []time.Duration, q float64) time.Duration {
	if len(samples) == 0 {
		return 0
	}
	s := slices.Clone(samples)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.5) - 1
	i = max(0, min(i, len(s)-1))
	return s[i]
}

func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
