package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.MethodOrderer;
import org.junit.jupiter.api.Order;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestMethodOrder;
import org.junit.jupiter.api.extension.ExtendWith;

/**
 * One client whose target lists two {@code cbserve serve} replicas (of the run's tiny model) while
 * calls flow without pause: the second replica starts after the calls have begun (its port open,
 * and its health NOT_SERVING, while its model loads) and then gets its share, and once the first
 * is killed the calls go on on the second. Not one call may fail: health checking keeps calls off
 * a replica still loading, and a call cut off by the kill is made again on the survivor. The
 * second test kills a replica, so the order is fixed.
 */
@ExtendWith(CbserveServerExtension.class)
@TestMethodOrder(MethodOrderer.OrderAnnotation.class)
class LoadBalancingTest {
  private static final Duration BOUND = Duration.ofSeconds(30);

  private static final List<CbserveServer> replicas = new ArrayList<>();
  private static final List<CbserveAdminClient> admins = new ArrayList<>();
  private static int[] secondPorts;
  private static CbserveClient client;

  @BeforeAll
  static void startFirstReplica(CbserveServer shared) throws Exception {
    replicas.add(CbserveServer.replica(shared.modelDir, "replica-a"));
    secondPorts = CbserveServer.freePorts();
    client =
        CbserveClient.builder()
            .targets(replicas.get(0).target, "127.0.0.1:" + secondPorts[0])
            .defaultTimeout(Duration.ofSeconds(10))
            .streamTimeout(Duration.ofSeconds(30))
            .build();
    admins.add(admin(replicas.get(0)));
  }

  @AfterAll
  static void stopReplicas() {
    if (client != null) {
      client.close();
    }
    admins.forEach(CbserveAdminClient::close);
    replicas.forEach(CbserveServer::close);
  }

  private static CbserveAdminClient admin(CbserveServer replica) {
    return CbserveAdminClient.builder()
        .target(replica.adminTarget)
        .token(CbserveServer.ADMIN_TOKEN)
        .defaultTimeout(Duration.ofSeconds(10))
        .build();
  }

  private static long finished(int replica) {
    return admins.get(replica).status().finishedRequests();
  }

  /** {@code generate} calls made back to back by three threads until {@link #stop()}. */
  private static final class CallFlow implements AutoCloseable {
    private final ExecutorService threads = Executors.newFixedThreadPool(3);
    private final AtomicBoolean running = new AtomicBoolean(true);
    private final AtomicInteger made = new AtomicInteger();
    private final List<String> failures = new ArrayList<>();

    CallFlow() {
      for (int i = 0; i < 3; i++) {
        threads.execute(
            () -> {
              while (running.get()) {
                try {
                  Completion c = client.generate(Prompt.text("flow"), ServerTest.greedy(2));
                  assertEquals(2, c.tokenIds().size());
                } catch (RuntimeException | AssertionError e) {
                  synchronized (failures) {
                    failures.add(e.toString());
                  }
                }
                made.incrementAndGet();
              }
            });
      }
    }

    /** Ends the flow and returns the failures, one line each. */
    List<String> stop() throws InterruptedException {
      running.set(false);
      threads.shutdown();
      assertTrue(threads.awaitTermination(60, TimeUnit.SECONDS), "the calls did not end");
      synchronized (failures) {
        return List.copyOf(failures);
      }
    }

    /** Stops the flow if a test ended without {@link #stop()} (an assertion failed). */
    @Override
    public void close() {
      running.set(false);
      threads.shutdownNow();
    }
  }

  @Test
  @Order(1)
  void aReplicaThatStartsWhileCallsFlowGetsCallsOnceServingAndNoneBefore() throws Exception {
    try (CallFlow calls = new CallFlow()) {
      CbserveServer second =
          CbserveServer.launch(replicas.get(0).modelDir, "replica-b", secondPorts);
      replicas.add(second);
      second.awaitServing();
      admins.add(admin(second));
      long[] joined = {finished(0), finished(1)};
      assertTrue(
          ServerTest.eventually(
              BOUND, () -> finished(0) > joined[0] && finished(1) > joined[1]),
          "requests finished since the second replica became SERVING: "
              + (finished(0) - joined[0]) + " and " + (finished(1) - joined[1])
              + "; expected both some");
      List<String> failures = calls.stop();
      assertEquals(List.of(), failures, failures.size() + " of " + calls.made + " calls failed");
    }
  }

  @Test
  @Order(2)
  void noCallFailsWhenAReplicaDies() throws Exception {
    try (CallFlow calls = new CallFlow()) {
      Thread.sleep(500); // calls in flight on both replicas
      replicas.get(0).kill();
      long survivorBefore = finished(1);
      assertTrue(
          ServerTest.eventually(BOUND, () -> finished(1) - survivorBefore >= 20),
          "the survivor finished " + (finished(1) - survivorBefore) + " requests after the kill");
      List<String> failures = calls.stop();
      assertEquals(List.of(), failures, failures.size() + " of " + calls.made + " calls failed");
    }
    assertEquals(CbserveServer.VOCAB_SIZE, client.modelInfo().vocabSize());
  }
}
