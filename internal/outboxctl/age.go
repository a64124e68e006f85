package outboxctl

import (
	"fmt"
	"math"
	"strconv"
	"time"
)

// ageFlag is a duration flag that takes an age as purge's flags do (7d,
// 1d12h) as well as anything time.ParseDuration reads (5m, 1.5h).
type ageFlag struct{ d time.Duration }

func (a *ageFlag) String() string { return a.d.String() }

func (a *ageFlag) Set(s string) error {
	d, ok := readAge(s)
	if !ok {
		return fmt.Errorf("want a duration: 7d, 36h, 90m, 1d12h, 1.5h")
	}
	a.d = d
	return nil
}

// readAge reads an age as parseAge does (7d, 1d12h) or as
// time.ParseDuration does (5m, 1.5h): every age flag takes both.
func readAge(s string) (time.Duration, bool) {
	if d, err := time.ParseDuration(s); err == nil {
		return d, true
	}
	return parseAge(s)
}

// parseAge reads an age as operators write one: whole numbers of days,
// hours, minutes or seconds, alone or in sequence: 7d, 36h, 90m, 45s, 1d12h.
// time.ParseDuration has no days, and an age in weeks of hours helps nobody.
func parseAge(s string) (time.Duration, bool) {
	if s == "" {
		return 0, false
	}
	var total time.Duration
	for s != "" {
		i := 0
		for i < len(s) && '0' <= s[i] && s[i] <= '9' {
			i++
		}
		if i == 0 || i == len(s) {
			return 0, false
		}
		n, err := strconv.ParseInt(s[:i], 10, 64)
		if err != nil {
			return 0, false
		}
		var unit time.Duration
		switch s[i] {
		case 'd':
			unit = 24 * time.Hour
		case 'h':
			unit = time.Hour
		case 'm':
			unit = time.Minute
		case 's':
			unit = time.Second
		default:
			return 0, false
		}
		if n > int64(math.MaxInt64/unit) || total > math.MaxInt64-time.Duration(n)*unit {
			return 0, false
		}
		total += time.Duration(n) * unit
		s = s[i+1:]
	}
	return total, true
}

// formatAge writes an age for people: seconds under a minute, then minutes
// and seconds, hours and minutes, days and hours.
func formatAge(d time.Duration) string {
	d = d.Round(time.Second)
	switch {
	case d < time.Minute:
		return strconv.Itoa(int(d/time.Second)) + "s"
	case d < time.Hour:
		return strconv.Itoa(int(d/time.Minute)) + "m" + strconv.Itoa(int(d%time.Minute/time.Second)) + "s"
	case d < 24*time.Hour:
		return strconv.Itoa(int(d/time.Hour)) + "h" + strconv.Itoa(int(d%time.Hour/time.Minute)) + "m"
	}
	return strconv.Itoa(int(d/(24*time.Hour))) + "d" + strconv.Itoa(int(d%(24*time.Hour)/time.Hour)) + "h"
}
