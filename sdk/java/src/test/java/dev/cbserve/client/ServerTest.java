package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.fail;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.function.BooleanSupplier;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.extension.ExtendWith;

/** Base of the end-to-end tests: a client and an admin client of the run's one server. */
@ExtendWith(CbserveServerExtension.class)
abstract class ServerTest {
  static CbserveServer server;
  static CbserveClient client;
  static CbserveAdminClient admin;

  @BeforeAll
  static void connect(CbserveServer started) {
    server = started;
    client =
        CbserveClient.builder()
            .target(server.target)
            .adminTarget(server.adminTarget)
            .adminToken(CbserveServer.ADMIN_TOKEN)
            .defaultTimeout(Duration.ofSeconds(30))
            .build();
    admin = client.admin();
  }

  @AfterAll
  static void disconnect() {
    if (client != null) {
      client.close();
    }
  }

  /** Greedy, exactly {@code n} new tokens (the tiny model has no EOS id anyway). */
  static SamplingParams greedy(int n) {
    return SamplingParams.builder().maxNewTokens(n).temperature(0).ignoreEos(true).build();
  }

  /** Every token of a stream, in order, checking that the deltas are contiguous. */
  static List<Integer> drainTokens(ChunkIterator chunks, int fromIndex) {
    List<Integer> tokens = new ArrayList<>();
    while (chunks.hasNext()) {
      Chunk chunk = chunks.next();
      if (!chunk.tokenIds().isEmpty() && chunk.tokenIndex() != fromIndex + tokens.size()) {
        fail("chunk at token index " + chunk.tokenIndex() + ", expected " + (fromIndex + tokens.size()));
      }
      tokens.addAll(chunk.tokenIds());
    }
    return tokens;
  }

  /** Waits up to {@code timeout} for {@code condition}, polling every 50 ms. */
  static boolean eventually(Duration timeout, BooleanSupplier condition) throws InterruptedException {
    long deadline = System.nanoTime() + timeout.toNanos();
    while (System.nanoTime() < deadline) {
      if (condition.getAsBoolean()) {
        return true;
      }
      Thread.sleep(50);
    }
    return condition.getAsBoolean();
  }

  /** Waits until no request is queued or running and no KV block is held. */
  static void assertIdle() throws InterruptedException {
    if (!eventually(
        Duration.ofSeconds(10),
        () -> {
          EngineStatus s = admin.status();
          return s.kvBlocksUsed() == 0 && s.activeRequests() == 0 && s.queuedRequests() == 0;
        })) {
      fail("the engine did not go idle: " + admin.status());
    }
  }
}
