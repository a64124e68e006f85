//go:build race

package outbox_test

// raceEnabled: the test binary was built with -race.
const raceEnabled = true
