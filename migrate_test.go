package outbox_test

import (
	"context"
	"io/fs"
	"sync"
	"testing"

	"github.com/jmoiron/sqlx"

	outbox "github.com/acemq/watermill-outbox"
	"github.com/acemq/watermill-outbox/internal/testdb"
	"github.com/acemq/watermill-outbox/sqlschema"
)

func TestMigrate_Twice_IsANoOp(t *testing.T) {
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		d := dialectOf(t, db)
		ctx := context.Background()
		for i := 0; i < 2; i++ {
			if err := outbox.Migrate(ctx, db.DB.DB, d); err != nil {
				t.Fatalf("migrate #%d: %v", i+1, err)
			}
		}
		assertMigratedOnce(t, db)
	})
}

// Several replicas of a service boot at once and each migrates: every one
// succeeds and the schema is applied once.
func TestMigrate_ConcurrentProcesses_AllSucceedSchemaAppliedOnce(t *testing.T) {
	for _, kind := range []string{testdb.Postgres, testdb.MySQL} {
		t.Run(kind, func(t *testing.T) {
			db := testdb.New(t, kind)
			d := dialectOf(t, db)
			const replicas = 4
			var wg sync.WaitGroup
			errs := make([]error, replicas)
			start := make(chan struct{})
			for i := 0; i < replicas; i++ {
				// A pool of its own per replica, as separate processes have.
				pool, err := sqlx.Open(db.DriverName(), db.DSN)
				if err != nil {
					t.Fatal(err)
				}
				defer pool.Close()
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					errs[i] = outbox.Migrate(context.Background(), pool.DB, d)
				}()
			}
			close(start)
			wg.Wait()
			for i, err := range errs {
				if err != nil {
					t.Errorf("replica %d: %v", i, err)
				}
			}
			assertMigratedOnce(t, db)
		})
	}
}

// A database migrated by golang-migrate or goose (the same files, no record in
// acemq_schema_migrations) is left as it is by Migrate.
func TestMigrate_AfterExternalTool_Succeeds(t *testing.T) {
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		d := dialectOf(t, db)
		migs, err := sqlschema.Migrations(d.Name())
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range migs {
			for _, stmt := range sqlschema.Statements(m.Up) {
				if _, err := db.Exec(stmt); err != nil {
					t.Fatalf("%s: %v", m.Name, err)
				}
			}
		}
		if err := outbox.Migrate(context.Background(), db.DB.DB, d); err != nil {
			t.Fatal(err)
		}
		assertMigratedOnce(t, db)
	})
}

func TestMigrations_DownUndoesUp(t *testing.T) {
	testdb.Each(t, func(t *testing.T, db *testdb.DB) {
		d := dialectOf(t, db)
		migs, err := sqlschema.Migrations(d.Name())
		if err != nil {
			t.Fatal(err)
		}
		if len(migs) < 2 {
			t.Fatalf("%d migrations, want at least 2", len(migs))
		}
		for _, m := range migs {
			for _, stmt := range sqlschema.Statements(m.Up) {
				if _, err := db.Exec(stmt); err != nil {
					t.Fatalf("%s up: %v", m.Name, err)
				}
			}
		}
		for i := len(migs) - 1; i >= 0; i-- {
			for _, stmt := range sqlschema.Statements(migs[i].Down) {
				if _, err := db.Exec(stmt); err != nil {
					t.Fatalf("%s down: %v", migs[i].Name, err)
				}
			}
		}
		for _, table := range []string{"acemq_outbox", "processed_messages"} {
			if _, err := db.Exec("SELECT 1 FROM " + table); err == nil {
				t.Errorf("%s still exists after the down migrations", table)
			}
		}
	})
}

func TestSQLSchema_GooseView_HoldsOnlyAnnotatedUpFiles(t *testing.T) {
	for _, d := range sqlschema.Dialects {
		fsys, err := sqlschema.Goose(d)
		if err != nil {
			t.Fatal(err)
		}
		migs, _ := sqlschema.Migrations(d)
		entries, err := fsReadDir(fsys)
		if err != nil {
			t.Fatal(err)
		}
		if len(entries) != len(migs) {
			t.Errorf("%s: goose view has %d files, want %d (one per version)", d, len(entries), len(migs))
		}
		for _, m := range migs {
			if len(m.Up) < 12 || m.Up[:12] != "-- +goose Up" {
				t.Errorf("%s/%s.up.sql does not start with the goose annotation", d, m.Name)
			}
		}
	}
}

func assertMigratedOnce(t *testing.T, db *testdb.DB) {
	t.Helper()
	var versions []int
	if err := db.Select(&versions, "SELECT version FROM acemq_schema_migrations ORDER BY version"); err != nil {
		t.Fatal(err)
	}
	migs, _ := sqlschema.Migrations(dialectOf(t, db).Name())
	if len(versions) != len(migs) {
		t.Fatalf("recorded versions %v, want one row for each of %d migrations", versions, len(migs))
	}
	for _, table := range []string{"acemq_outbox", "processed_messages"} {
		var n int
		if err := db.Get(&n, "SELECT COUNT(*) FROM "+table); err != nil {
			t.Errorf("%s: %v", table, err)
		}
	}
}

func fsReadDir(fsys fs.FS) ([]fs.DirEntry, error) { return fs.ReadDir(fsys, ".") }
