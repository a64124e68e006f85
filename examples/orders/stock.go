package main

import (
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
)

type product struct {
	name       string
	priceCents int64
	perOrder   int // how many an order of it buys
	inStock    int // at the start of a run
}

// products: the grinder and the kettle run short, so that some orders fail
// their reservation. Every run starts with the same stock and places the
// same orders, so its output is the same every time.
var products = map[string]product{
	"beans":   {name: "coffee beans", priceCents: 1200, perOrder: 2, inStock: 1000},
	"grinder": {name: "grinder", priceCents: 8900, perOrder: 1, inStock: 1},
	"kettle":  {name: "kettle", priceCents: 4500, perOrder: 1, inStock: 2},
	"filters": {name: "paper filters", priceCents: 250, perOrder: 3, inStock: 1000},
}

// basket is the order of products that orders cycle through.
var basket = []string{"beans", "grinder", "kettle", "filters"}

// newOrder is the i-th order of a run (from 0), with an id of its own.
func newOrder(i int) order {
	sku := basket[i%len(basket)]
	p := products[sku]
	return order{ID: watermill.NewUUID(), SKU: sku, Quantity: p.perOrder, TotalCents: p.priceCents * int64(p.perOrder)}
}

var errOutOfStock = errors.New("out of stock")

// inventory stands in for the warehouse service the order transaction asks
// for a reservation.
type inventory struct {
	mu     sync.Mutex
	onHand map[string]int
}

func newInventory() *inventory {
	inv := &inventory{onHand: map[string]int{}}
	for sku, p := range products {
		inv.onHand[sku] = p.inStock
	}
	return inv
}

func (inv *inventory) reserve(sku string, qty int) error {
	inv.mu.Lock()
	defer inv.mu.Unlock()
	if inv.onHand[sku] < qty {
		return fmt.Errorf("%s %w", products[sku].name, errOutOfStock)
	}
	inv.onHand[sku] -= qty
	return nil
}

func (inv *inventory) release(sku string, qty int) {
	inv.mu.Lock()
	defer inv.mu.Unlock()
	inv.onHand[sku] += qty
}
