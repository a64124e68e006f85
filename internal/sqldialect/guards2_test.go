package sqldialect

import (
	"testing"
	"time"
)

// A numeric timestamp SQLite hands back raw (an aggregate loses the
// column's type) reads as the driver reads one through the column: Unix
// milliseconds when it has 13 digits or more, else Unix seconds.
func TestReadTime_SQLiteNumbers_MillisecondsAndSeconds(t *testing.T) {
	at := time.Date(2026, 12, 2, 3, 4, 5, 678e6, time.UTC)
	for _, c := range []struct {
		v    int64
		want time.Time
	}{
		{at.UnixMilli(), at},
		{at.Unix(), at.Truncate(time.Second)},
	} {
		got, err := readTime(sqlite{}, c.v)
		if err != nil || !got.Equal(c.want) {
			t.Errorf("readTime(%d) = %v, %v; want %v", c.v, got, err, c.want)
		}
	}
}
