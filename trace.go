package outbox

import (
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/propagation"
)

// metadataCarrier lets an OpenTelemetry propagator read and write a
// message's metadata, which is the outbox row's headers and, through the
// relay, the AMQP headers: a W3C traceparent set at publish reaches the
// consumer as it was.
type metadataCarrier message.Metadata

var _ propagation.TextMapCarrier = metadataCarrier(nil)

func (c metadataCarrier) Get(key string) string { return c[key] }

func (c metadataCarrier) Set(key, value string) { c[key] = value }

func (c metadataCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}
