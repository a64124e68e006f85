//go:build !race

package integration_test

// raceEnabled: the test binary was built with -race.
const raceEnabled = false
